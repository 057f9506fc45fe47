"""DeepSeek V4 (``DeepseekV4ForCausalLM``).

  h = embed(ids)                                     [T, H]
  R = h copied into hc_mult residual streams         [T, hc, H]
  per layer:  x = norm(hc_pre_attn(R));  R = hc_post(attn(x), R)
              x = norm(hc_pre_ffn(R));   R = hc_post(moe(x), R)
  y = norm(hc_head(R));  logits = head(y)

Every sublayer output is complete (TP-reduced) before its hc_post. On CUDA each hc_post is fused
with the next sublayer's hc_pre and RMSNorm (``mhc_fused_post_pre``, the same maths as
post-then-pre); only the first layer's attention pre and the last layer's MoE post are separate
calls. Elsewhere (CPU) the layers run the unfused torch steps, :func:`hc_pre_torch_impl` then
``hc_post_torch_impl``, which the kernels are tested against.

Parameter names follow the official checkpoint (``embed.weight``, ``layers.L.attn.wq_a.weight``,
``layers.L.ffn.experts...``, ``hc_head_fn``, ``head.weight``), so the loader maps checkpoint names
straight onto ``named_parameters()``. Routed experts live in each layer's ``FusedMoE``.

A batch is a list of requests, each with its own :class:`DeepseekV4RequestCache`: projections, mHC
and MoE run over all rows at once; attention and the compressors walk the requests. With a slot
pool (:meth:`DeepseekV4ForCausalLM.enable_slot_pool`) request caches can live in preallocated
slots, and :meth:`~DeepseekV4ForCausalLM.static_decode` runs a decode step over them with fixed
shapes (the body of the decode CUDA graphs); the eager forward stays the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from sglang.srt.layers.attention.dsv4_attention import AttnSegment, DeepseekV4Attention
from sglang.srt.layers.attention.dsv4_kv_layout import DeepseekV4KVLayout
from sglang.srt.layers.attention.dsv4_static_decode import static_decode_attention
from sglang.srt.layers.build_spec import DEFAULT_BUILD_SPEC, LayerBuildSpec
from sglang.srt.layers.dp_attention import attention_spec, dp_gather, dp_scatter
from sglang.srt.layers.embedding import ReplicatedEmbedding
from sglang.srt.layers.layernorm import RMSNorm, rms_norm
from sglang.srt.layers.linear import ReplicatedLinear, fp32_param
from sglang.srt.layers.mhc import (
    MhcParams,
    hc_post_torch_impl,
    mhc_fused_post_pre,
    mhc_head,
    mhc_post,
    mhc_pre,
    mhc_pre_torch,
)
from sglang.srt.mem_cache.deepseek_v4_cache import (
    DeepseekV4CacheShape,
    DeepseekV4RequestCache,
    new_request_cache,
)
from sglang.srt.mem_cache.deepseek_v4_slot_pool import DeepseekV4SlotPool
from sglang.srt.mem_cache.memory_models.deepseek_v4 import CacheShape
from sglang.srt.mem_cache.slot_blocks import SlotPoolSize
from sglang.srt.models.cached_lm import CachedCausalLM, RequestBatch
from sglang.srt.models.deepseek_v4_checkpoint import checkpoint_rules
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.deepseek_v4_moe import DeepseekV4MoE
from sglang.srt.models.registry import ModelEntry, register_model
from sglang.srt.models.static_step import SlotPoolDecode


class DeepseekV4Batch(RequestBatch[DeepseekV4RequestCache]):
    """The requests of one forward, in row order: ``seq_lens[i]`` new tokens for ``caches[i]``."""


# The attention of layer i on its normed input: eager (per-request caches) or static (slot pool).
AttendFn = Callable[[int, "DeepseekV4DecoderLayer", torch.Tensor], torch.Tensor]

# (fn, scale, base) of the mHC entering one sublayer, and the model's mHC constants with that
# sublayer's RMSNorm
HCParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor, MhcParams]


def hc_pre_torch_impl(
    residual: torch.Tensor, hc: HCParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sublayer's mHC pre in plain torch, its RMSNorm a separate step (upstream's unfused
    non-CUDA branch): ``residual [T, hc, H]`` -> (normed layer input ``[T, H]``, post ``[T, hc]``,
    comb ``[T, hc, hc]`` fp32). ``hc`` is the sublayer's ``(fn, scale, base, params)``. The
    model's path off CUDA."""
    fn, scale, base, params = hc
    y, post, comb = mhc_pre_torch(residual, fn, scale, base, params)
    assert params.norm_weight is not None and params.norm_eps is not None
    return rms_norm(y, params.norm_weight, params.norm_eps), post, comb


def _hc_pre(
    residual: torch.Tensor, hc: HCParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first sublayer's pre: the kernel (norm fused) on CUDA, else :func:`hc_pre_torch_impl`."""
    if not residual.is_cuda:
        return hc_pre_torch_impl(residual, hc)
    return mhc_pre(residual, *hc)


def _post_then_pre(
    out: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    hc: HCParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sublayer's ``hc_post`` then the next sublayer's ``hc_pre`` and RMSNorm, whose
    ``(fn, scale, base, params)`` is ``hc``: ``(residual, x, post, comb)`` for the next.
    Fused in one kernel call on CUDA; unfused torch steps elsewhere."""
    if not residual.is_cuda:
        new_residual = hc_post_torch_impl(out, residual, post, comb)
        return (new_residual, *hc_pre_torch_impl(new_residual, hc))
    return mhc_fused_post_pre(out, residual, post, comb, *hc)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4ModelConfig, layer_id: int, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        hc, h = c.hc_mult, c.hidden_size
        n_mix = (2 + hc) * hc  # [pre(hc) | post(hc) | comb(hc*hc)]
        device = spec.device
        self.norm_eps = c.rms_norm_eps
        self.attn_norm = RMSNorm(h, c.rms_norm_eps, device=device)
        self.ffn_norm = RMSNorm(h, c.rms_norm_eps, device=device)
        # DP attention: attention is split (and all-reduced) over the attention-TP group, the MoE
        # over all ranks.
        self.attn = DeepseekV4Attention(
            c.attention_config(layer_id), layer_id, attention_spec(spec)
        )
        self.ffn = DeepseekV4MoE(c, layer_id, spec)
        self.hc_attn_fn = fp32_param(n_mix, hc * h, device=device)
        self.hc_attn_base = fp32_param(n_mix, device=device)
        self.hc_attn_scale = fp32_param(3, device=device)
        self.hc_ffn_fn = fp32_param(n_mix, hc * h, device=device)
        self.hc_ffn_base = fp32_param(n_mix, device=device)
        self.hc_ffn_scale = fp32_param(3, device=device)

    def hc_attn(self, mhc: MhcParams) -> HCParams:
        """(fn, scale, base, the model's ``mhc`` with the norm) entering the attention sublayer."""
        params = mhc.with_norm(self.attn_norm.weight, self.norm_eps)
        return self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, params

    def hc_ffn(self, mhc: MhcParams) -> HCParams:
        params = mhc.with_norm(self.ffn_norm.weight, self.norm_eps)
        return self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, params


class DeepseekV4ForCausalLM(CachedCausalLM[DeepseekV4RequestCache], SlotPoolDecode):
    batch_type = DeepseekV4Batch

    def __init__(
        self, config: DeepseekV4ModelConfig, spec: LayerBuildSpec = DEFAULT_BUILD_SPEC
    ) -> None:
        super().__init__(spec)
        c = config
        self.config = c
        device = spec.device
        # Embedding and LM head are replicated (the vocab-parallel split is a memory optimisation).
        self.embed = ReplicatedEmbedding(c.vocab_size, c.hidden_size, spec)
        self.layers: nn.ModuleList = nn.ModuleList(
            DeepseekV4DecoderLayer(c, i, spec) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        self.hc_head_fn = fp32_param(c.hc_mult, c.hc_mult * c.hidden_size, device=device)
        self.hc_head_base = fp32_param(c.hc_mult, device=device)
        self.hc_head_scale = fp32_param(1, device=device)
        # The mHC constants of every layer (each sublayer adds its own norm) and of the head.
        self.mhc = MhcParams(c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        self.head = ReplicatedLinear(c.hidden_size, c.vocab_size, spec)
        self.slot_pool: DeepseekV4SlotPool | None = None  # see enable_slot_pool
        self.kv_layout = DeepseekV4KVLayout.build(
            head_dim=c.head_dim,
            rope_dim=c.rope_head_dim,
            index_head_dim=c.index_head_dim,
            dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype,
        )
        self.cache_shape = DeepseekV4CacheShape(
            attn_types=c.attn_types,
            compress_ratios=c.compress_ratios,
            sliding_window=c.sliding_window,
            head_dim=c.head_dim,
            index_head_dim=c.index_head_dim,
            dtype=spec.dtype,
            entry_codec=self.kv_layout.entries,
            index_codec=self.kv_layout.index_keys,
        )

    @property
    def decoder_layers(self) -> list[DeepseekV4DecoderLayer]:
        """``self.layers`` with its element type (ModuleList indexing is untyped)."""
        return cast(list[DeepseekV4DecoderLayer], list(self.layers))

    # --- caches --------------------------------------------------------------------------------

    def new_request_cache(self) -> DeepseekV4RequestCache:
        return new_request_cache(self.cache_shape, device=self.device)

    def memory_model(self) -> CacheShape:
        """What a cached token, a request's window rings and a step's workspace cost this rank
        (the default ``--max-total-tokens``), in the bytes the caches store
        (``--kv-cache-dtype``)."""
        layout = self.kv_layout
        if not layout.choice.fp8:  # every row in the model dtype: the shape's own arithmetic
            return CacheShape.from_model_config(self.config, self.dtype.itemsize)
        return CacheShape.from_model_config(
            self.config,
            self.dtype.itemsize,
            entry_bytes=layout.entries.row_bytes,
            index_key_bytes=layout.index_keys.row_bytes,
            kv_cache=layout.choice.name,
        )

    # --- slot pool -----------------------------------------------------------------------------

    def new_slot_pool(self, size: SlotPoolSize) -> DeepseekV4SlotPool:
        """Window rings by slot; compressed entries and indexer keys in the shared blocks."""
        return DeepseekV4SlotPool(self.cache_shape, size, device=self.device)

    # --- forward -------------------------------------------------------------------------------

    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: RequestBatch[DeepseekV4RequestCache],
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        # Static decode steps leave the layers' host counters behind (see decode_pooled); the
        # eager attention reads and extends them, so catch them up first. Pooled caches get the
        # blocks these rows write first.
        for cache in batch.caches:
            cache.sync_layers()
        self.reserve_blocks(batch.caches, batch.seq_lens)
        starts = batch.starts()

        def attend(i: int, layer: DeepseekV4DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            segments = [
                AttnSegment(starts[r], batch.seq_lens[r], batch.caches[r].layers[i])
                for r in range(len(batch.caches))
            ]
            return layer.attn(x, positions, segments)

        return self._run_layers(input_ids, attend, logit_rows)

    @torch.no_grad()
    def static_decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token for each of ``bs`` requests with fixed shapes and no host sync (the body of
        a decode CUDA graph): ``input_ids``, ``positions``, ``slots`` ``[bs]`` (int64; padding rows
        use ``slot_pool.scratch_slot``) -> logits ``[bs, V]``. Writes the slots' caches; host
        counts are the caller's (:meth:`decode_pooled` keeps them)."""
        pool = self._slot_pool()

        def attend(i: int, layer: DeepseekV4DecoderLayer, x: torch.Tensor) -> torch.Tensor:
            store = pool.layers[i]
            return static_decode_attention(
                layer.attn, x, positions, slots, store, pool.blocks.table
            )

        return self._run_layers(input_ids, attend)

    @torch.no_grad()
    def forward_idle(self) -> torch.Tensor:
        """DP attention, this rank's group has no rows this step: join every MoE block's gather
        and collectives with zero rows (the other groups' tokens run through it); logits
        ``[0, V]``."""
        c = self.config
        x = torch.empty(0, c.hidden_size, dtype=self.dtype, device=self.device)
        moe_ids = dp_gather(torch.empty(0, dtype=torch.long, device=self.device))
        for layer in self.decoder_layers:
            dp_scatter(layer.ffn(dp_gather(x), moe_ids))
        return self.empty_logits(c.vocab_size)

    def _run_layers(
        self, input_ids: torch.Tensor, attend: AttendFn, logit_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embedding, every layer (``attend(i, layer, x)`` is the attention), mHC head, logits
        (of ``logit_rows`` only, when given)."""
        c, mhc = self.config, self.mhc
        t = input_ids.shape[0]
        h = self.embed(input_ids)
        residual = h.unsqueeze(1).expand(t, c.hc_mult, c.hidden_size).contiguous()

        layers = self.decoder_layers
        x, post, comb = _hc_pre(residual, layers[0].hc_attn(mhc))
        moe_ids = dp_gather(input_ids)  # DP attention: the MoE sees every group's tokens
        for i, layer in enumerate(layers):
            a = attend(i, layer, x)
            residual, x, post, comb = _post_then_pre(a, residual, post, comb, layer.hc_ffn(mhc))
            m = dp_scatter(layer.ffn(dp_gather(x), moe_ids))  # identities without DP attention
            if i + 1 < len(layers):
                residual, x, post, comb = _post_then_pre(
                    m, residual, post, comb, layers[i + 1].hc_attn(mhc)
                )
            else:
                residual = mhc_post(m, residual, post, comb)
        if logit_rows is not None:  # the mHC head, norm and LM head are per token
            if logit_rows.numel() == 0:  # no rows' logits wanted (no GEMM over zero rows)
                return self.empty_logits(c.vocab_size)
            residual = residual.index_select(0, logit_rows)
        y = mhc_head(residual, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, mhc)
        return self.head(self.norm(y)).float()


register_model(
    ModelEntry(
        architecture="DeepseekV4ForCausalLM",
        model_types=("deepseek_v4",),
        config_class=DeepseekV4ModelConfig,
        model_class=DeepseekV4ForCausalLM,
        batch_class=DeepseekV4Batch,
        checkpoint_rules=checkpoint_rules,
        supports_dp_attention=True,
    )
)
