"""KDA (Kimi Delta Attention): the linear-attention layer of Kimi Linear and Kimi K3.

For normed input ``x [T, hidden]`` (all projections bias-free):
  q, k, v = silu(causal depthwise conv(q_proj x | k_proj x | v_proj x))     [T, H, D] each
  q = l2norm(q) * D^-1/2 ;  k = l2norm(k)                                   fp32
  g = forget gate(f_b(f_a(x)) + dt_bias, A_log)                             [T, H, D] log decay
  beta = sigmoid(b_proj x)                                                  [T, H]
  o = delta rule(q, k, v, g, beta; per-request state)                       [T, H, D]
  out = o_proj(rmsnorm_D(o) * o_norm.weight * sigmoid(gate(x)))
The output gate is ``g_proj`` (full rank, K3) or ``g_b_proj(g_a_proj x)`` (low rank, Kimi Linear).

A batch is a list of request segments. Multi-token segments (prefill, or a prefill chunk on top of
a cached prefix) run the chunked form; single-token segments (decode) run one batched conv and
recurrent step: on a GPU the Triton kernels of ``kda_decode.py`` (states updated in place through
a table of their addresses), else torch on the stacked states. Both read and update the
request's conv and recurrent state in place.

Tensor parallel: heads are split by rank (q/k/v/f_b/b/g projections column-parallel, their conv
weights, ``dt_bias`` and ``A_log`` sliced alike); ``f_a`` and ``g_a`` are replicated; ``o_proj`` is
row-parallel and reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sglang.srt.environ import envs
from sglang.srt.layers.attention.kda_chunk import DEFAULT_CHUNK_SIZE, kda_chunked
from sglang.srt.layers.attention.kda_conv import causal_conv_decode, causal_conv_prefill
from sglang.srt.layers.attention.kda_decode import decode_rows, kernel_decode, kernel_decode_reason
from sglang.srt.layers.attention.kda_gate import kda_beta, kda_forget_gate, l2norm
from sglang.srt.layers.attention.kda_params import ShortConvWeight, a_log_param
from sglang.srt.layers.attention.kda_prefill import (
    kernel_conv_prefill,
    kernel_prefill,
    prefill_kernel_reason,
)
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    dim0_sharded_param,
    per_rank,
)
from sglang.srt.mem_cache.kimi_k3_cache import KDAState
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)

# K3 builds o_norm without an eps argument, so it keeps this value whatever rms_norm_eps is.
KDA_O_NORM_EPS = 1e-5


@dataclass(frozen=True)
class KDAConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    conv_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: the plain softplus gate
    full_rank_gate: bool = True  # g_proj; False: g_a_proj / g_b_proj
    o_norm_eps: float = KDA_O_NORM_EPS
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.conv_size < 2:
            raise ValueError(f"KDA short conv size must be >= 2, got {self.conv_size}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ValueError(f"KDA gate lower bound must be negative, got {self.gate_lower_bound}")


@dataclass(frozen=True)
class KDASegment:
    """Rows ``[start, start + length)`` of the batch belong to the request owning ``state``."""

    start: int
    length: int
    state: KDAState


def gated_rms_norm(o: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """``rmsnorm(o) * weight * sigmoid(gate)`` over the last dim, fp32 maths, result in o's
    dtype."""
    of = o.float()
    y = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(o.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: KDAConfig, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        self.config = c
        self.local_heads = per_rank(c.num_heads, spec.tp_size, "KDA heads")
        width = c.num_heads * c.head_dim
        self.q_proj = ColumnParallelLinear(c.hidden_size, width, spec)
        self.k_proj = ColumnParallelLinear(c.hidden_size, width, spec)
        self.v_proj = ColumnParallelLinear(c.hidden_size, width, spec)
        self.q_conv1d = ShortConvWeight(width, c.conv_size, spec)
        self.k_conv1d = ShortConvWeight(width, c.conv_size, spec)
        self.v_conv1d = ShortConvWeight(width, c.conv_size, spec)
        self.f_a_proj = ReplicatedLinear(c.hidden_size, c.head_dim, spec)
        self.f_b_proj = ColumnParallelLinear(c.head_dim, width, spec)
        self.b_proj = ColumnParallelLinear(c.hidden_size, c.num_heads, spec)
        self.g_proj: ColumnParallelLinear | None = None
        self.g_a_proj: ReplicatedLinear | None = None
        self.g_b_proj: ColumnParallelLinear | None = None
        if c.full_rank_gate:
            self.g_proj = ColumnParallelLinear(c.hidden_size, width, spec)
        else:
            self.g_a_proj = ReplicatedLinear(c.hidden_size, c.head_dim, spec)
            self.g_b_proj = ColumnParallelLinear(c.head_dim, width, spec)
        self.A_log = a_log_param(c.num_heads, spec)
        self.dt_bias = dim0_sharded_param((width,), spec)
        self.o_norm = RMSNorm(c.head_dim, c.o_norm_eps, device=spec.device)
        self.o_proj = RowParallelLinear(width, c.hidden_size, spec)

    @property
    def local_width(self) -> int:
        return self.local_heads * self.config.head_dim

    def conv_weight(self) -> Tensor:
        """The q, k and v conv weights as one ``[3 * C_local, W]`` (channels in q | k | v order)."""
        return torch.cat(
            [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0
        ).squeeze(1)

    def output_gate(self, x: Tensor) -> Tensor:
        if self.g_proj is not None:
            return self.g_proj(x)
        assert self.g_a_proj is not None and self.g_b_proj is not None
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: Tensor, segments: Sequence[KDASegment]) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (reduced over the TP group); updates each
        segment's state in place."""
        t = x.shape[0]
        h, d = self.local_heads, self.config.head_dim
        if sum(s.length for s in segments) != t:
            raise ValueError(f"KDA segments cover {sum(s.length for s in segments)} rows of {t}")
        mixed, g, beta = self.project(x)
        core = torch.zeros(t, h, d, dtype=torch.float32, device=x.device)
        weight = self.conv_weight()
        decode: list[KDASegment] = []
        for seg in segments:
            if seg.length == 1:
                decode.append(seg)
            elif seg.length > 1:
                self._prefill_segment(seg, mixed, g, beta, weight, core)
        if decode:
            self._decode_step(mixed, g, beta, decode, weight, core)
        return self.finish(x, core)

    def _prefill_segment(
        self,
        seg: KDASegment,
        mixed: Tensor,
        g: Tensor,
        beta: Tensor,
        weight: Tensor,
        core: Tensor,
    ) -> None:
        """A multi-token segment: the conv over its rows, then the chunked delta rule (the Triton
        kernels where they run, else torch) into ``core``; its states are updated in place."""
        rows = slice(seg.start, seg.start + seg.length)
        mode = envs.SGLANG_K3_KDA_PREFILL.get()
        why = prefill_kernel_reason(mixed, self.config.head_dim, self.config.gate_lower_bound, mode)
        log_path_once(logger, f"Kimi K3 KDA prefill (SGLANG_K3_KDA_PREFILL={mode})", why)
        conv = causal_conv_prefill if why is not None else kernel_conv_prefill
        conv_out, conv_state = conv(mixed[rows], weight, seg.state.conv)
        q, k, v = self.split_qkv(conv_out)
        recurrent = seg.state.recurrent
        if why is None:
            kernel_prefill(q, k, v, g[rows], beta[rows], recurrent, core[rows], mode)
        else:
            o, state = kda_chunked(
                q, k, v, g[rows], beta[rows], recurrent, chunk_size=self.config.chunk_size
            )
            core[rows] = o
            recurrent.copy_(state)
        seg.state.conv.copy_(conv_state)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The per-token inputs of the core: ``mixed [T, 3 * H * D]`` (q | k | v before the
        conv), the log decay ``g [T, H, D]`` and ``beta [T, H]`` (fp32)."""
        t = x.shape[0]
        h, d = self.local_heads, self.config.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        gate_in = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias
        g = kda_forget_gate(gate_in.view(t, h, d), self.A_log, self.config.gate_lower_bound)
        return mixed, g, kda_beta(self.b_proj(x))

    def finish(self, x: Tensor, core: Tensor) -> Tensor:
        """The core output ``core [T, H, D]`` (fp32) through the gated norm and ``o_proj``."""
        t = x.shape[0]
        h, d = self.local_heads, self.config.head_dim
        # The core output is rounded to the activation dtype before its norm, as the reference does.
        gate = self.output_gate(x).view(t, h, d)
        out = gated_rms_norm(core.to(x.dtype), self.o_norm.weight, gate, self.config.o_norm_eps)
        return self.o_proj(out.reshape(t, h * d))

    def split_qkv(self, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[..., 3C]`` -> q (normed, scaled), k (normed), v as ``[..., H, D]`` fp32."""
        h, d = self.local_heads, self.config.head_dim
        q, k, v = (p.unflatten(-1, (h, d)) for p in conv_out.split(self.local_width, dim=-1))
        return l2norm(q) * d**-0.5, l2norm(k), v.float()

    def _decode_step(
        self,
        mixed: Tensor,
        g: Tensor,
        beta: Tensor,
        decode: list[KDASegment],
        weight: Tensor,
        core: Tensor,
    ) -> None:
        """One token for each of ``B`` requests, batched: the kernels on the states in place, or
        torch on the stacked states, written back."""
        states = [s.state for s in decode]
        h, d = self.local_heads, self.config.head_dim
        why = kernel_decode_reason(mixed, weight, states, h, d)
        log_path_once(logger, "Kimi K3 KDA decode step", why)
        if why is None:
            table = decode_rows([s.start for s in decode], states, mixed.device)
            kernel_decode(mixed, g, beta, table, weight, core, d)
            return
        rows = torch.tensor([s.start for s in decode], dtype=torch.long, device=mixed.device)
        self.torch_decode(mixed, g, beta, rows, states, weight, core)

    def torch_decode(
        self,
        mixed: Tensor,
        g: Tensor,
        beta: Tensor,
        rows: Tensor,
        states: Sequence[KDAState],
        weight: Tensor,
        core: Tensor,
    ) -> None:
        """The torch decode step (the reference, and the CPU path): stack the states of the
        batch rows ``rows``, step them, write ``core[rows]`` and copy the states back."""
        conv_states = torch.stack([s.conv for s in states])
        rec_states = torch.stack([s.recurrent for s in states])
        conv_out, conv_new = causal_conv_decode(mixed[rows], weight, conv_states)
        q, k, v = self.split_qkv(conv_out)
        o, rec_new = kda_recurrent(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            g[rows].unsqueeze(1),
            beta[rows].unsqueeze(1),
            rec_states,
        )
        core[rows] = o[:, 0]
        for i, state in enumerate(states):
            state.conv.copy_(conv_new[i])
            state.recurrent.copy_(rec_new[i])
