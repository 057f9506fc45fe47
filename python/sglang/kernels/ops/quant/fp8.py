"""FP8 (e4m3) block quantisation: per-token-group activations and 2-D block weights.

Activations: each row is cut into groups of ``group_size`` (128) consecutive values along K, one
fp32 scale per group, ``scale = max(amax, eps) / 448`` so that the group's largest value maps to
the e4m3 maximum. Weights [..., N, K]: one fp32 scale per ``block`` (128 x 128) tile. Dequantised
values are ``q * scale``. The activation quantiser runs as a Triton kernel on CUDA (and under
``TRITON_INTERPRET=1``) and in torch elsewhere; the weight functions are torch (load time, tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_EPS = 1e-10  # keeps all-zero groups from dividing by zero (they quantise to 0)


@triton.jit
def quant_rows_fp8(x, eps):
    """Per row of an fp32 [M, G] block: ``scale = max(amax, eps) / 448`` and ``x / scale`` clamped
    to the e4m3 range -> (q fp32 [M, G], scale fp32 [M]). ``q`` stays fp32 so each caller casts it
    to its own output's e4m3 element type at the store; this kernel and the MegaMoE intermediate
    quantiser share it, so both round the same values the same way."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, eps) / 448.0
    q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    return q, scale


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    num_groups,
    stride_x_row,
    stride_q_row,
    stride_s_row,
    stride_s_group,
    eps,
    GROUP: tl.constexpr,
    GROUPS_PER_PROG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = groups[:, None] < num_groups
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quant_rows_fp8(x, eps)
    tl.store(q_ptr + row * stride_q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s_row + groups * stride_s_group, scale, mask=groups < num_groups)


def _quant_groups_torch(
    x: torch.Tensor, group_size: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = x.shape
    xg = x.float().view(rows, k // group_size, group_size)
    scale = xg.abs().amax(dim=-1).clamp(min=eps) / FP8_MAX
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, k), scale


def empty_group_scales(
    rows: int, groups: int, device: torch.device | str, *, mn_major: bool = False
) -> torch.Tensor:
    """An uninitialised fp32 ``[rows, groups]`` for per-group scales. ``mn_major``: column-major
    with the row count padded to 4 (16 bytes), the layout DeepGEMM's SM90 FP8 GEMMs read
    activation scales in (given any other, they copy them into it first)."""
    if not mn_major:
        return torch.empty((rows, groups), dtype=torch.float32, device=device)
    aligned = -(-rows // 4) * 4
    return torch.empty((groups, aligned), dtype=torch.float32, device=device)[:, :rows].t()


def quant_fp8_unfit_reason(group_size: int) -> str | None:
    """None when the quantiser kernel takes groups of ``group_size`` (a power of two; the family
    on; about 1024 values a program in registers), else why the torch quantiser runs."""
    if group_size < 1 or group_size & (group_size - 1):
        return f"the Triton quantiser needs a power-of-two group_size, got {group_size}"
    return unfit_reason("fp8_quant")


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    eps: float = DEFAULT_EPS,
    *,
    use_triton: bool | None = None,
    scale_mn_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., K] to e4m3 with one fp32 scale per ``group_size`` values of a row.

    Returns ``(q [..., K] float8_e4m3fn, scale [..., K/group_size] fp32)``. ``use_triton``
    defaults to "on CUDA or under the Triton interpreter". ``scale_mn_major``: the scales in
    :func:`empty_group_scales`' column-major layout (DeepGEMM's)."""
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"last dim {k} is not a multiple of group_size {group_size}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if use_triton is None:
        use_triton = triton_can_run(x) and quant_fp8_unfit_reason(group_size) is None
    if not use_triton:
        q, scale = _quant_groups_torch(x2, group_size, eps)
        if scale_mn_major:
            laid = empty_group_scales(*scale.shape, x.device, mn_major=True)
            scale = laid.copy_(scale)
        return q.view(*lead, k), scale.view(*lead, k // group_size)
    if group_size & (group_size - 1):
        raise ValueError(f"the Triton quantiser needs a power-of-two group_size, got {group_size}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, num_groups = x2.shape[0], k // group_size
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = empty_group_scales(rows, num_groups, x.device, mn_major=scale_mn_major)
    if rows and num_groups:
        # About 1024 values a program: enough work per CTA without spilling registers.
        per_prog = min(triton.next_power_of_2(num_groups), max(1, 1024 // group_size))
        grid = (rows, triton.cdiv(num_groups, per_prog))
        _per_token_group_quant_kernel[grid](
            x2,
            q,
            scale,
            num_groups,
            x2.stride(0),
            q.stride(0),
            scale.stride(0),
            scale.stride(1),
            eps,
            GROUP=group_size,
            GROUPS_PER_PROG=per_prog,
            num_warps=4,
        )
    return q.view(*lead, k), scale.view(*lead, num_groups)


def _check_block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    bn, bk = int(block[0]), int(block[1])
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be positive, got {tuple(block)}")
    return bn, bk


def _pad_last2(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    if t.shape[-2] == n and t.shape[-1] == k:
        return t
    return torch.nn.functional.pad(t, (0, k - t.shape[-1], 0, n - t.shape[-2]))


def block_quant_weight_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` [..., N, K] to e4m3 with one fp32 scale per ``block`` tile.

    Returns ``(q [..., N, K], scale [..., ceil(N/bn), ceil(K/bk)])``; partial edge tiles get
    their own scale. Works one [N, K] matrix at a time to bound the fp32 temporaries."""
    bn, bk = _check_block(block)
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    lead = w.shape[:-2]
    flat = w.reshape(-1, n, k)
    q = torch.empty((flat.shape[0], n, k), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((flat.shape[0], nb, kb), dtype=torch.float32, device=w.device)
    for i in range(flat.shape[0]):
        tiles = _pad_last2(flat[i].float(), nb * bn, kb * bk).view(nb, bn, kb, bk)
        s = tiles.abs().amax(dim=(1, 3)).clamp(min=eps) / FP8_MAX
        qi = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        q[i] = qi.view(nb * bn, kb * bk)[:n, :k]
        scale[i] = s
    return q.view(*lead, n, k), scale.view(*lead, nb, kb)


def block_dequant_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | list[int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q`` [..., N, K] times its per-tile ``scale`` [..., ceil(N/bn), ceil(K/bk)] -> ``dtype``
    (the product is taken in fp32)."""
    bn, bk = _check_block(block)
    n, k = q.shape[-2], q.shape[-1]
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    if tuple(scale.shape[-2:]) != (nb, kb) or scale.shape[:-2] != q.shape[:-2]:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
            f"with block {(bn, bk)}"
        )
    lead = q.shape[:-2]
    tiles = _pad_last2(q.float(), nb * bn, kb * bk).view(*lead, nb, bn, kb, bk)
    out = tiles * scale.float()[..., :, None, :, None]
    return out.view(*lead, nb * bn, kb * bk)[..., :n, :k].to(dtype).contiguous()
