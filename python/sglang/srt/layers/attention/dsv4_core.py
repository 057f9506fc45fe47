"""The attention maths of one DeepSeek V4 request, in torch (CPU path and reference).

MQA with one KV head where K = V. A query at position ``p`` attends, in one softmax:
- the raw KV rows of positions ``p - window + 1 .. p`` (sliding window, itself included);
- the compressed entries marked visible for it (all complete blocks for ratio-128 layers, the
  indexer's top-k for ratio-4 layers);
- a per-head sink: an extra logit whose value row is zero (it only absorbs probability).
Output ``o = probs @ K`` per head. Maths in fp32; queries are processed in chunks so memory stays
``O(chunk * (window + chunk + entries))`` for any sequence length.

Where Triton runs and the shapes fit (:func:`prefill_kernel_reason`), the layer runs
``sparse_prefill_attention`` instead (:mod:`sglang.kernels.ops.attention`): the same maths over
only the keys each query sees (the indexer's picks as ids, not a mask), with bf16 tensor-core
products that are exact, so only the summation order differs from this path.
"""

from __future__ import annotations

import torch

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.attention.sparse_prefill_attention import prefill_unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run

_QUERY_CHUNK = 256


def dsv4_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_first: int,
    win_kv: torch.Tensor,
    win_first_pos: int,
    comp_kv: torch.Tensor | None,
    comp_visible: torch.Tensor | None,
    sink: torch.Tensor,
    *,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Attention of one request's new queries.

    ``q [n, heads, D]`` at positions ``q_pos [n]`` (contiguous: ``q_first .. q_first + n - 1``;
    ``q_first`` is passed from the host so picking each chunk's window rows never reads the device);
    ``win_kv [m, D]``: raw KV rows of positions ``win_first_pos .. win_first_pos + m - 1``, covering
    at least each query's window; ``comp_kv [N, D]`` with ``comp_visible [n, N]`` (bool);
    ``sink [heads]``. Returns fp32 ``[n, heads, D]``."""
    n, heads, dim = q.shape
    out = torch.empty(n, heads, dim, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    kv_pos = win_first_pos + torch.arange(win_kv.shape[0], device=q.device)
    comp = None if comp_kv is None or comp_kv.shape[0] == 0 else comp_kv.float()
    sink_logit = sink.float().view(1, heads, 1)
    for a in range(0, n, _QUERY_CHUNK):
        b = min(a + _QUERY_CHUNK, n)
        qp = q_pos[a:b]
        # Only the rows some query of this chunk can see (positions q_first + a .. q_first + b - 1).
        lo = max(q_first + a - window + 1 - win_first_pos, 0)
        hi = q_first + b - win_first_pos
        kw = win_kv[lo:hi].float()
        kp = kv_pos[lo:hi]
        qc = q[a:b].float()
        logits = torch.einsum("qhd,kd->qhk", qc, kw) * scale
        seen = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
        logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
        parts = [logits]
        if comp is not None:
            assert comp_visible is not None
            lc = torch.einsum("qhd,nd->qhn", qc, comp) * scale
            parts.append(lc.masked_fill(~comp_visible[a:b, None, :], float("-inf")))
        parts.append(sink_logit.expand(b - a, heads, 1))
        probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
        o = torch.einsum("qhk,kd->qhd", probs[..., : kw.shape[0]], kw)
        if comp is not None:
            o = o + torch.einsum(
                "qhn,nd->qhd", probs[..., kw.shape[0] : kw.shape[0] + comp.shape[0]], comp
            )
        out[a:b] = o
    return out


def prefill_kernel_reason(q: torch.Tensor, key_dtype: torch.dtype) -> str | None:
    """None when the Triton prefill kernel takes queries ``q [n, heads, D]`` over keys of
    ``key_dtype``, else why the torch path above runs."""
    if not triton_can_run(q):
        return "Triton does not run on this device"
    return prefill_unfit_reason(q.shape[-1], key_dtype, q.dtype, limits_for(q))
