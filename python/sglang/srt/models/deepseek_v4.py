"""DeepSeek V4 (``DeepseekV4ForCausalLM``).

  h = embed(ids)                                     [T, H]
  R = h copied into hc_mult residual streams         [T, hc, H]
  per layer:  x = norm(hc_pre_attn(R));  R = hc_post(attn(x), R)
              x = norm(hc_pre_ffn(R));   R = hc_post(moe(x), R)
  y = norm(hc_head(R));  logits = head(y)

Every sublayer output is complete (TP-reduced) before its hc_post. Each hc_post is fused with the
next sublayer's hc_pre and RMSNorm (``mhc_fused_post_pre``, the same maths as post-then-pre); only
the first layer's attention pre and the last layer's MoE post are separate calls.

Parameter names follow the official checkpoint (``embed.weight``, ``layers.L.attn.wq_a.weight``,
``layers.L.ffn.experts...``, ``hc_head_fn``, ``head.weight``), so the loader maps checkpoint names
straight onto ``named_parameters()``. Routed experts live in each layer's ``FusedMoE``.

A batch is a list of requests, each with its own :class:`DeepseekV4RequestCache`: projections, mHC
and MoE run over all rows at once; attention and the compressors walk the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from sglang.kernels.ops.layernorm.mhc import mhc_fused_post_pre, mhc_head, mhc_post, mhc_pre
from sglang.srt.layers.attention.dsv4_attention import AttnSegment, DeepseekV4Attention
from sglang.srt.layers.embedding import ReplicatedEmbedding
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear, attach_loader, default_weight_loader
from sglang.srt.layers.moe.layer import A2ABackend
from sglang.srt.mem_cache.deepseek_v4_cache import DeepseekV4RequestCache, new_request_cache
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.deepseek_v4_moe import DeepseekV4MoE


@dataclass(frozen=True)
class DeepseekV4Batch:
    """The requests of one forward, in row order: ``seq_lens[i]`` new tokens for ``caches[i]``."""

    seq_lens: Sequence[int]
    caches: Sequence[DeepseekV4RequestCache]

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.caches):
            raise ValueError(f"{len(self.seq_lens)} sequence lengths for {len(self.caches)} caches")


def _fp32_param(*shape: int, device: torch.device | str) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device), requires_grad=False)
    return attach_loader(p, default_weight_loader)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DeepseekV4ModelConfig,
        layer_id: int,
        *,
        params_dtype: torch.dtype,
        tp_rank: int,
        tp_size: int,
        moe_runner: str,
        a2a_backend: A2ABackend,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        c = config
        hc, h = c.hc_mult, c.hidden_size
        n_mix = (2 + hc) * hc  # [pre(hc) | post(hc) | comb(hc*hc)]
        self.attn_norm = RMSNorm(h, c.rms_norm_eps, device=device)
        self.ffn_norm = RMSNorm(h, c.rms_norm_eps, device=device)
        self.attn = DeepseekV4Attention(
            c, layer_id, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size, device=device
        )
        self.ffn = DeepseekV4MoE(
            c, layer_id, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size,
            moe_runner=moe_runner, a2a_backend=a2a_backend, device=device,
        )  # fmt: skip
        self.hc_attn_fn = _fp32_param(n_mix, hc * h, device=device)
        self.hc_attn_base = _fp32_param(n_mix, device=device)
        self.hc_attn_scale = _fp32_param(3, device=device)
        self.hc_ffn_fn = _fp32_param(n_mix, hc * h, device=device)
        self.hc_ffn_base = _fp32_param(n_mix, device=device)
        self.hc_ffn_scale = _fp32_param(3, device=device)

    def hc_attn(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fn, scale, base, norm weight) entering the attention sublayer."""
        return self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm.weight

    def hc_ffn(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm.weight


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(
        self,
        config: DeepseekV4ModelConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
        moe_runner: str = "auto",
        a2a_backend: A2ABackend = "none",
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Embedding and LM head are replicated (the vocab-parallel split is a memory optimisation).
        self.embed = ReplicatedEmbedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers: nn.ModuleList = nn.ModuleList(
            DeepseekV4DecoderLayer(
                c,
                i,
                params_dtype=dtype,
                tp_rank=tp_rank,
                tp_size=tp_size,
                moe_runner=moe_runner,
                a2a_backend=a2a_backend,
                device=device,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        self.hc_head_fn = _fp32_param(c.hc_mult, c.hc_mult * c.hidden_size, device=device)
        self.hc_head_base = _fp32_param(c.hc_mult, device=device)
        self.hc_head_scale = _fp32_param(1, device=device)
        self.head = ReplicatedLinear(c.hidden_size, c.vocab_size, params_dtype=dtype, device=device)

    @property
    def decoder_layers(self) -> list[DeepseekV4DecoderLayer]:
        """``self.layers`` with its element type (ModuleList indexing is untyped)."""
        return cast(list[DeepseekV4DecoderLayer], list(self.layers))

    # --- caches --------------------------------------------------------------------------------

    def new_request_cache(self) -> DeepseekV4RequestCache:
        c = self.config
        return new_request_cache(
            attn_types=c.attn_types, compress_ratios=c.compress_ratios, sliding_window=c.sliding_window,
            head_dim=c.head_dim, index_head_dim=c.index_head_dim, dtype=self.dtype, device=self.device,
        )  # fmt: skip

    # --- forward -------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: DeepseekV4Batch | None = None
    ) -> torch.Tensor:
        """Logits ``[T, V]`` (fp32) for ``input_ids [T]`` at ``positions [T]``.

        Without ``batch`` the rows are one whole request from position 0 (a throw-away cache).
        With ``batch`` each request's rows must continue its cache (positions ``len(cache) ..``);
        the caches are extended in place."""
        if batch is None:
            batch = DeepseekV4Batch([input_ids.shape[0]], [self.new_request_cache()])
        self._check_batch(input_ids, positions, batch)
        c = self.config
        mix: dict[str, Any] = {
            "rms_eps": c.rms_norm_eps,
            "hc_eps": c.hc_eps,
            "sinkhorn_iters": c.hc_sinkhorn_iters,
        }
        t = input_ids.shape[0]
        h = self.embed(input_ids)
        residual = h.unsqueeze(1).expand(t, c.hc_mult, c.hidden_size).contiguous()

        layers = self.decoder_layers
        fn, scale, base, norm_w = layers[0].hc_attn()
        x, post, comb = mhc_pre(
            residual, fn, scale, base, norm_weight=norm_w, norm_eps=c.rms_norm_eps, **mix
        )
        starts = [0]
        for n in batch.seq_lens:
            starts.append(starts[-1] + n)
        for i, layer in enumerate(layers):
            segments = [
                AttnSegment(starts[r], batch.seq_lens[r], batch.caches[r].layers[i])
                for r in range(len(batch.caches))
            ]
            a = layer.attn(x, positions, segments)
            fn, scale, base, norm_w = layer.hc_ffn()
            residual, x, post, comb = mhc_fused_post_pre(
                a,
                residual,
                post,
                comb,
                fn,
                scale,
                base,
                norm_weight=norm_w,
                norm_eps=c.rms_norm_eps,
                **mix,
            )
            m = layer.ffn(x, input_ids)
            if i + 1 < len(layers):
                fn, scale, base, norm_w = layers[i + 1].hc_attn()
                residual, x, post, comb = mhc_fused_post_pre(
                    m,
                    residual,
                    post,
                    comb,
                    fn,
                    scale,
                    base,
                    norm_weight=norm_w,
                    norm_eps=c.rms_norm_eps,
                    **mix,
                )
            else:
                residual = mhc_post(m, residual, post, comb)
        for cache, n in zip(batch.caches, batch.seq_lens):
            cache.num_tokens += n
        y = mhc_head(
            residual,
            self.hc_head_fn,
            self.hc_head_scale,
            self.hc_head_base,
            rms_eps=c.rms_norm_eps,
            hc_eps=c.hc_eps,
        )
        return self.head(self.norm(y)).float()

    def prefill(self, input_ids: torch.Tensor, cache: DeepseekV4RequestCache) -> torch.Tensor:
        """Append ``input_ids [n]`` to one request; logits of those tokens ``[n, V]``."""
        start = len(cache)
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        return self.forward(input_ids, positions, DeepseekV4Batch([input_ids.shape[0]], [cache]))

    def decode(
        self, input_ids: torch.Tensor, caches: Sequence[DeepseekV4RequestCache]
    ) -> torch.Tensor:
        """One new token per request: ``input_ids [B]`` -> logits ``[B, V]``."""
        positions = torch.tensor(
            [len(cc) for cc in caches], dtype=torch.long, device=input_ids.device
        )
        return self.forward(input_ids, positions, DeepseekV4Batch([1] * len(caches), list(caches)))

    def _check_batch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: DeepseekV4Batch
    ) -> None:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]"
            )
        if sum(batch.seq_lens) != input_ids.shape[0]:
            raise ValueError(
                f"sequence lengths {list(batch.seq_lens)} do not sum to {input_ids.shape[0]} rows"
            )
        if any(n < 0 for n in batch.seq_lens):
            raise ValueError(f"negative sequence length in {list(batch.seq_lens)}")
        if positions.is_cuda:
            return  # the check below reads positions back to the host
        start = 0
        for n, cache in zip(batch.seq_lens, batch.caches):
            want = torch.arange(len(cache), len(cache) + n, dtype=positions.dtype)
            if not torch.equal(positions[start : start + n].cpu(), want):
                raise ValueError(
                    f"positions of a request must continue its cache ({len(cache)} tokens cached): "
                    f"got {positions[start : start + n].tolist()[:8]}..."
                )
            start += n
