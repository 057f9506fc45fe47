"""Kimi K3 (text): ``KimiK3ForCausalLM``.

  P = embed(ids)                                            the AttnRes partial sum   [T, H]
  per layer i:
    x = input_layernorm(AttnRes read over [bank, P]);  if i % B == 0: bank += [P]; P = 0
    P += attn(x)            KDA (linear attention, per-request state) or NoPE MLA (latent cache)
    x = post_attention_layernorm(AttnRes read over [bank, P])
    P += ffn(x)             dense SiTU MLP (i < first_k_dense_replace) or the latent MoE
  logits = lm_head(norm(AttnRes read over [bank, P])) * logit_scale      (fp32)
With ``attn_res_block_size`` null the reads become plain pre-norm residuals (h += f(norm(h))).
Layer kinds come from the config's 1-based ``kda_layers`` / ``full_attn_layers``.

Parameter names follow the checkpoint after the wrapper prefix is stripped
(``model.layers.N.self_attn.q_proj.weight``, ``model.layers.N.mlp.gate.weight`` for the
checkpoint's ``block_sparse_moe``, ``lm_head.weight``), so the loader maps names straight onto
``named_parameters()``; routed experts live in each MoE layer's ``FusedMoE``.

A batch is a list of requests, each with its own :class:`KimiK3RequestCache`; prefill chunks and
decode rows mix freely: projections, norms and MoE run over all rows at once, attention walks the
requests (KDA runs all decode rows in one batched conv and recurrent step). With a slot pool
(:meth:`KimiK3ForCausalLM.enable_slot_pool`) caches live in preallocated slots (KDA states by
slot, MLA latents paged in its blocks), read and written in place by the eager forward and by
:meth:`~KimiK3ForCausalLM.static_decode`, a decode step with fixed shapes (the body of the decode
CUDA graphs, ``kimi_k3_static_decode.py``; the executor takes it only with
``SGLANG_K3_STATIC_DECODE``); the eager forward stays the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from sglang.srt.layers.attention.kda import KDAConfig, KDASegment, KimiDeltaAttention
from sglang.srt.layers.attention.mla_kv_layout import KimiK3KVLayout
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig, MLASegment
from sglang.srt.layers.attn_res import AttnResState, attn_res_score_vector
from sglang.srt.layers.build_spec import DEFAULT_BUILD_SPEC, LayerBuildSpec
from sglang.srt.layers.dp_attention import attention_spec, dp_gather, dp_scatter
from sglang.srt.layers.embedding import ReplicatedEmbedding
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.mem_cache.kimi_k3_cache import (
    KDAState,
    KimiK3RequestCache,
    MLALatentCache,
    new_request_cache,
)
from sglang.srt.mem_cache.kimi_k3_slot_pool import KimiK3SlotPool
from sglang.srt.mem_cache.memory_models.kimi_k3 import KimiK3MemoryModel
from sglang.srt.mem_cache.slot_blocks import SlotPoolSize
from sglang.srt.models.cached_lm import CachedCausalLM, RequestBatch
from sglang.srt.models.kimi_k3_checkpoint import checkpoint_rules
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_mlp import KimiK3MLP
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.models.kimi_k3_static_decode import static_attend, static_decode_gate_reason
from sglang.srt.models.registry import ModelEntry, register_model
from sglang.srt.models.static_step import SlotPoolDecode

_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KimiK3Batch(RequestBatch[KimiK3RequestCache]):
    """The requests of one forward, in row order: ``seq_lens[i]`` new tokens for ``caches[i]``."""


# The attention of a layer on its normed input: eager (the batch's caches) or static (slot pool).
AttendFn = Callable[["KimiK3DecoderLayer", Tensor], Tensor]


class KimiK3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: KimiK3Config,
        layer_id: int,
        spec: LayerBuildSpec,
    ) -> None:
        super().__init__()
        c = config
        h = c.hidden_size
        device = spec.device
        self.layer_id = layer_id
        self.is_kda = c.is_kda(layer_id)
        # DP attention: KDA and MLA are split (and all-reduced) over the attention-TP group; the
        # FFN (MoE or dense) spans all ranks on every group's gathered rows.
        attn_spec = attention_spec(spec)
        self.self_attn: KimiDeltaAttention | MLANoPEAttention
        if self.is_kda:
            kda = KDAConfig(
                hidden_size=h,
                num_heads=c.kda_num_heads,
                head_dim=c.kda_head_dim,
                conv_size=c.kda_conv_size,
                gate_lower_bound=c.kda_gate_lower_bound,
                full_rank_gate=c.kda_full_rank_gate,
            )
            self.self_attn = KimiDeltaAttention(kda, attn_spec)
        else:
            mla = MLANoPEConfig(
                hidden_size=h,
                num_heads=c.num_attention_heads,
                q_lora_rank=c.q_lora_rank,
                kv_lora_rank=c.kv_lora_rank,
                qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim,
                rms_norm_eps=c.rms_norm_eps,
                output_gate=c.mla_use_output_gate,
            )
            self.self_attn = MLANoPEAttention(mla, attn_spec)
        self.mlp: KimiK3MoE | KimiK3MLP
        if c.is_moe(layer_id):
            self.mlp = KimiK3MoE(c, spec)
        else:
            self.mlp = KimiK3MLP(h, c.intermediate_size, spec, activation=c.moe_activation)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, device=device)
        self.has_attn_res = c.attn_res_block_size is not None
        if self.has_attn_res:
            self.self_attention_res_norm = RMSNorm(h, c.rms_norm_eps, device=device)
            self.self_attention_res_proj = ReplicatedLinear(h, 1, spec)
            self.mlp_res_norm = RMSNorm(h, c.rms_norm_eps, device=device)
            self.mlp_res_proj = ReplicatedLinear(h, 1, spec)

    def ffn(self, x: Tensor) -> Tensor:
        """The MoE or dense MLP on this group's rows ``x``: under DP attention every group's rows
        are gathered before it and this group's taken back after (identities otherwise)."""
        return dp_scatter(self.mlp(dp_gather(x)))

    def attention(
        self, x: Tensor, starts: Sequence[int], batch: RequestBatch[KimiK3RequestCache]
    ) -> Tensor:
        i = self.layer_id
        if isinstance(self.self_attn, KimiDeltaAttention):
            kda_segs = [
                KDASegment(s, n, cast(KDAState, cache.layers[i]))
                for s, n, cache in zip(starts, batch.seq_lens, batch.caches)
            ]
            return self.self_attn(x, kda_segs)
        mla_segs = [
            MLASegment(s, n, cast(MLALatentCache, cache.layers[i]))
            for s, n, cache in zip(starts, batch.seq_lens, batch.caches)
        ]
        return self.self_attn(x, mla_segs)


class KimiK3Model(nn.Module):
    """Embedding, decoder layers and the final norm (plus the final AttnRes read site)."""

    def __init__(self, config: KimiK3Config, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        device = spec.device
        self.embed_tokens = ReplicatedEmbedding(c.vocab_size, c.hidden_size, spec)
        self.layers = nn.ModuleList(
            KimiK3DecoderLayer(c, i, spec) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        if c.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
            self.output_attn_res_proj = ReplicatedLinear(c.hidden_size, 1, spec)


class KimiK3ForCausalLM(CachedCausalLM[KimiK3RequestCache], SlotPoolDecode):
    batch_type = KimiK3Batch

    def __init__(self, config: KimiK3Config, spec: LayerBuildSpec = DEFAULT_BUILD_SPEC) -> None:
        super().__init__(spec)
        c = config
        self.config = c
        self.model = KimiK3Model(c, spec)
        # The ranks attention (and so each request's KDA state) is split over.
        self.attn_tp_size = attention_spec(spec).tp_size
        self.cache_shape = c.cache_shape(kda_heads=c.kda_num_heads // self.attn_tp_size)
        # Replicated (the vocab-parallel split is a memory optimisation).
        self.lm_head = ReplicatedLinear(c.hidden_size, c.vocab_size, spec)
        self.slot_pool: KimiK3SlotPool | None = None  # see enable_slot_pool
        self.kv_layout = KimiK3KVLayout.build(
            kv_lora_rank=c.kv_lora_rank,
            rope_dim=c.qk_rope_head_dim,
            dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype,
        )

    @property
    def decoder_layers(self) -> list[KimiK3DecoderLayer]:
        """``self.model.layers`` with its element type (ModuleList indexing is untyped)."""
        return cast(list[KimiK3DecoderLayer], list(self.model.layers))

    # --- caches --------------------------------------------------------------------------------

    def new_request_cache(self) -> KimiK3RequestCache:
        return new_request_cache(
            self.cache_shape,
            dtype=self.dtype,
            state_dtype=self._state_dtype,
            device=self.device,
            latent_encoding=self.kv_layout.latents,
        )

    def memory_model(self) -> KimiK3MemoryModel:
        """What a cached token (the MLA latents), a running request (the KDA states of this
        rank's heads) and a step's workspace cost this rank, from the shape the slot pool
        allocates (the default ``--max-total-tokens``)."""
        c = self.config
        return KimiK3MemoryModel(
            pool=self.cache_shape,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            bank_rows=c.num_bank_rows,
            dtype_bytes=self.dtype.itemsize,
            state_dtype_bytes=self._state_dtype.itemsize,
            latent_row_bytes=self.kv_layout.latents.row_bytes,
            kv_cache=self.kv_layout.choice.name,
        )

    @property
    def _state_dtype(self) -> torch.dtype:
        """The KDA recurrent states' dtype."""
        return _STATE_DTYPES[self.config.kda_state_dtype]

    # --- forward -------------------------------------------------------------------------------

    def forward_batch(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: RequestBatch[KimiK3RequestCache],
        logit_rows: Tensor | None,
    ) -> Tensor:
        self.reserve_blocks(batch.caches, batch.seq_lens)
        starts = batch.starts()

        def attend(layer: KimiK3DecoderLayer, x: Tensor) -> Tensor:
            return layer.attention(x, starts, batch)

        return self._run_layers(input_ids, attend, logit_rows)

    # --- static decode (slot pool; kimi_k3_static_decode.py) ----------------------------------

    def static_decode_gate_reason(self) -> str | None:
        """Why the executor must not take this model's static decode yet (None: it may)."""
        return static_decode_gate_reason()

    def new_slot_pool(self, size: SlotPoolSize) -> KimiK3SlotPool:
        """KDA states by slot; MLA latents in the shared blocks."""
        return KimiK3SlotPool(
            self.cache_shape,
            size,
            dtype=self.dtype,
            state_dtype=self._state_dtype,
            device=self.device,
            latent_encoding=self.kv_layout.latents,
        )

    @torch.no_grad()
    def static_decode(self, input_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """One token for each of ``bs`` requests with fixed shapes and no host sync (the body of
        a decode CUDA graph): ``input_ids``, ``positions``, ``slots`` ``[bs]`` (int64; padding rows
        use ``slot_pool.scratch_slot`` at position 0) -> logits ``[bs, V]``. Writes the slots'
        states and latents; host counts are the caller's (:meth:`decode_pooled` keeps them)."""
        return self._run_layers(input_ids, static_attend(self._slot_pool(), positions, slots))

    def _run_layers(
        self, input_ids: Tensor, attend: AttendFn, logit_rows: Tensor | None = None
    ) -> Tensor:
        """Embedding, every layer (``attend(layer, x)`` is its attention), the last read, norm
        and LM head (of ``logit_rows`` only, when given): logits fp32."""
        c = self.config
        eps = c.rms_norm_eps
        h = self.model.embed_tokens(input_ids)
        block = c.attn_res_block_size
        if block is None:
            y = self._plain_residual_layers(h, attend, logit_rows)
        else:
            state = AttnResState(h)
            for layer in self.decoder_layers:
                attn_score = attn_res_score_vector(
                    layer.self_attention_res_norm, layer.self_attention_res_proj
                )
                x = state.read(attn_score, eps, layer.input_layernorm)
                if layer.layer_id % block == 0:
                    state.write_bank()
                state.add(attend(layer, x))
                mlp_score = attn_res_score_vector(layer.mlp_res_norm, layer.mlp_res_proj)
                state.add(layer.ffn(state.read(mlp_score, eps, layer.post_attention_layernorm)))
            out_score = attn_res_score_vector(
                self.model.output_attn_res_norm, self.model.output_attn_res_proj
            )
            if logit_rows is not None:  # the last read, norm and LM head are per token
                state = state.select_rows(logit_rows)
            y = state.read(out_score, eps, self.model.norm)
        if y.shape[0] == 0:  # no rows' logits wanted (no GEMM over zero rows)
            return self.empty_logits(c.vocab_size)
        logits = self.lm_head(y).float()
        return logits if c.logit_scale == 1.0 else logits * c.logit_scale

    @torch.no_grad()
    def forward_idle(self) -> Tensor:
        """DP attention, this rank's group has no rows this step: join every FFN's gather and
        collectives with zero rows (the other groups' tokens run through it); logits ``[0, V]``.
        Attention and AttnRes are per group, so an idle group skips them."""
        c = self.config
        x = torch.empty(0, c.hidden_size, dtype=self.dtype, device=self.device)
        for layer in self.decoder_layers:
            layer.ffn(x)
        return self.empty_logits(c.vocab_size)

    def _plain_residual_layers(
        self, h: Tensor, attend: AttendFn, logit_rows: Tensor | None
    ) -> Tensor:
        for layer in self.decoder_layers:
            h = h + attend(layer, layer.input_layernorm(h))
            h = h + layer.ffn(layer.post_attention_layernorm(h))
        if logit_rows is not None:  # the final norm and LM head are per token
            h = h.index_select(0, logit_rows)
        return self.model.norm(h)


register_model(
    ModelEntry(
        architecture="KimiK3ForCausalLM",
        model_types=("kimi_k3", "kimi_linear"),
        config_class=KimiK3Config,
        model_class=KimiK3ForCausalLM,
        batch_class=KimiK3Batch,
        checkpoint_rules=checkpoint_rules,
        supports_dp_attention=True,
    )
)
