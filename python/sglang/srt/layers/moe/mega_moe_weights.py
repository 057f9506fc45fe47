"""Routed-expert weights re-laid out for DeepGEMM's MegaMoE kernels (a one-off transform at load).

Accepted inputs (this rank's experts as the checkpoint stores them, stacked ``w13 = [gate; up]``):

- **MXFP4** -> the Blackwell ``fp8_fp4_mega_moe`` layout (mma ``fp8xfp4``):
  ``w13`` uint8/int8 ``[E, 2I, H/2]`` and ``w2 [E, H, I/2]`` (two E2M1 values a byte), with UE8M0
  scales ``[E, 2I, H/32]`` / ``[E, H, I/32]`` as raw bytes (uint8 or float8_e8m0fnu) or as fp32
  powers of two. Output:
  ``l1 = (w13 int8, rows interleaved gate/up by 8; sf int32 [E, 2I, H/128], rows interleaved the
  same way, then UTCCP-transposed)`` and ``l2 = (w2 int8; sf int32 [E, H, I/128], UTCCP)``. The
  scales go through ``deep_gemm.transform_sf_into_required_layout(recipe=(1, 32))`` first, which
  packs four UE8M0 bytes into an int32 along K and stores them MN-major.
- **FP8** e4m3 with one fp32 scale per 128x128 block -> the Hopper ``fp8_mega_moe`` layout:
  ``l1 = (w13 rows interleaved gate/up by 8, scales [E, 2I/128, H/128] unchanged)``,
  ``l2 = (w2, scales unchanged)``.

bf16 experts (and FP8 with other block shapes) have no MegaMoE layout: :class:`MegaMoEFormatError`.
Shapes the kernels cannot tile (``H`` or ``I`` not a multiple of 128) raise
:class:`MegaMoEWeightError` naming the tensor.

Why the re-layout: the kernel computes ``gate`` and ``up`` of the same output column in one MMA
tile, so their rows must sit 8 apart rather than ``I`` apart; the tensor core reads block scales
from tensor memory through UTCCP copies, which take each 128-row block as 4 x 32 rows transposed
to 32 x 4. :func:`unbuild_mega_moe_experts_weights` undoes all of it (the fake kernel uses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang.kernels.ops.moe.mxfp4_weights import GATE_UP_GRANULE as INTERLEAVE_ROWS
from sglang.kernels.ops.moe.mxfp4_weights import SF_PER_WORD as SF_PER_INT32
from sglang.kernels.ops.moe.mxfp4_weights import UTCCP_BLOCK
from sglang.srt.layers.deep_gemm_adapter import resolve_entry_point
from sglang.srt.layers.quantization.mxfp4 import (
    MXFP4_DTYPES,
    MXFP4_GROUP,
    UE8M0_BIAS,
    ue8m0_to_float,
)

Tensor = torch.Tensor
MegaWeights = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]

MXFP4_SF_RECIPE = (1, MXFP4_GROUP)  # one scale per row and per 32 values along K
FP8_BLOCK = 128
_UE8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


class MegaMoEWeightError(ValueError):
    """The experts cannot be laid out for the MegaMoE kernel (bad shape or dtype)."""


class MegaMoEFormatError(MegaMoEWeightError):
    """The experts' format has no MegaMoE layout (e.g. bf16): the layer keeps the normal path."""


@dataclass(frozen=True)
class UnbuiltExperts:
    """The checkpoint layout recovered from MegaMoE weights (``fmt`` "mxfp4" or "fp8"); MXFP4
    scales come back as UE8M0 bytes (uint8), FP8 scales as the fp32 block scales."""

    fmt: str
    w13: Tensor
    w2: Tensor
    w13_scale: Tensor
    w2_scale: Tensor


# --- the layout pieces, each with its inverse ---------------------------------------------------


def _same_strides_copy(t: Tensor, value: Tensor) -> Tensor:
    # empty_like keeps the input's stride order, so an MN-major scale tensor stays MN-major.
    return torch.empty_like(t).copy_(value)


def interleave_gate_up(t: Tensor, granule: int = INTERLEAVE_ROWS) -> Tensor:
    """``[E, 2I, ...]`` with rows ``[gate | up]`` -> rows
    ``[g0..g7, u0..u7, g8..g15, u8..u15, ...]``."""
    e, n, *rest = t.shape
    if n % (2 * granule):
        raise MegaMoEWeightError(
            f"L1 rows ({n} = 2 x intermediate) must be a multiple of {2 * granule} to interleave "
            f"gate/up in granules of {granule}"
        )
    half = n // 2
    gate = t[:, :half].reshape(e, half // granule, granule, *rest)
    up = t[:, half:].reshape(e, half // granule, granule, *rest)
    return _same_strides_copy(t, torch.stack([gate, up], dim=2).reshape(e, n, *rest))


def deinterleave_gate_up(t: Tensor, granule: int = INTERLEAVE_ROWS) -> Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    e, n, *rest = t.shape
    if n % (2 * granule):
        raise MegaMoEWeightError(f"{n} rows are not whole gate/up granules of {granule}")
    pairs = t.reshape(e, n // (2 * granule), 2, granule, *rest)
    gate, up = pairs[:, :, 0].reshape(e, n // 2, *rest), pairs[:, :, 1].reshape(e, n // 2, *rest)
    return _same_strides_copy(t, torch.cat([gate, up], dim=1))


def _check_utccp(sf: Tensor) -> tuple[int, int, int]:
    if sf.dim() != 3 or sf.dtype != torch.int32:
        raise MegaMoEWeightError(
            f"UTCCP scales must be packed int32 [E, MN, K/128], got {sf.dtype} {tuple(sf.shape)}"
        )
    rows = UTCCP_BLOCK[0] * UTCCP_BLOCK[1]
    if sf.shape[1] % rows:
        raise MegaMoEWeightError(f"UTCCP needs MN ({sf.shape[1]}) to be a multiple of {rows}")
    return sf.shape[0], sf.shape[1], sf.shape[2]


def utccp_transpose(sf: Tensor) -> Tensor:
    """Each 128-row block of ``[E, MN, K']`` viewed as 4 x 32 rows and transposed to 32 x 4:
    row ``i*32 + j`` of a block moves to row ``j*4 + i``."""
    e, mn, k = _check_utccp(sf)
    a, b = UTCCP_BLOCK
    return _same_strides_copy(
        sf, sf.reshape(e, mn // (a * b), a, b, k).transpose(2, 3).reshape(e, mn, k)
    )


def utccp_untranspose(sf: Tensor) -> Tensor:
    """Inverse of :func:`utccp_transpose`."""
    e, mn, k = _check_utccp(sf)
    a, b = UTCCP_BLOCK
    return _same_strides_copy(
        sf, sf.reshape(e, mn // (a * b), b, a, k).transpose(2, 3).reshape(e, mn, k)
    )


def ue8m0_bytes(scale: Tensor, what: str) -> Tensor:
    """UE8M0 scales as uint8 exponent bytes, from raw bytes or fp32 powers of two."""
    if scale.dtype in _UE8M0_DTYPES:
        return scale.view(torch.uint8)
    if scale.dtype == torch.float32:
        mantissa, exponent = torch.frexp(scale)
        if not bool(torch.all(mantissa == 0.5)):
            raise MegaMoEWeightError(f"{what}: fp32 MXFP4 scales must be positive powers of two")
        return (exponent.to(torch.int32) - 1 + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    raise MegaMoEWeightError(
        f"{what}: MXFP4 scales must be UE8M0 bytes (uint8 / float8_e8m0fnu) or fp32, got "
        f"{scale.dtype}"
    )


def unpack_ue8m0_words(sf: Tensor) -> Tensor:
    """int32 ``[..., MN, K/128]`` (four UE8M0 bytes a word, the lowest byte the first K group, any
    strides) -> uint8 ``[..., MN, K/32]``."""
    *lead, mn, words = sf.shape
    # a fresh row-major copy: .contiguous() keeps odd strides on size-1 dims, which .view rejects
    row_major = torch.empty(sf.shape, dtype=sf.dtype, device=sf.device).copy_(sf)
    return row_major.view(torch.uint8).reshape(*lead, mn, words * SF_PER_INT32)


# --- build / unbuild ----------------------------------------------------------------------------


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise MegaMoEWeightError(msg)


def _check_tiling(hidden: int, inter: int) -> None:
    # UTCCP reads 128-row blocks (L2 rows = H); packed scale words cover 4 x 32 = 128 K values
    # (L1 K = H, L2 K = I); the kernels tile the expert width by 128.
    for name, value in (("hidden", hidden), ("intermediate", inter)):
        _require(
            value % 128 == 0,
            f"MegaMoE needs the expert {name} size ({value}) to be a multiple of 128",
        )


def _transform_sf(
    deep_gemm: Any, sf: Tensor, mn: int, k: int, num_groups: int, what: str
) -> Tensor:
    out = deep_gemm.transform_sf_into_required_layout(
        ue8m0_to_float(sf),
        mn,
        k,
        recipe=MXFP4_SF_RECIPE,
        num_groups=num_groups,
        disable_ue8m0_cast=False,
    )
    want = (num_groups, mn, k // (MXFP4_GROUP * SF_PER_INT32))
    _require(
        out.dtype == torch.int32 and tuple(out.shape) == want,
        f"deep_gemm.transform_sf_into_required_layout gave {out.dtype} {tuple(out.shape)} for "
        f"{what}, "
        f"expected int32 {want}",
    )
    return out


def _build_mxfp4(deep_gemm: Any, w13: Tensor, w2: Tensor, s13: Tensor, s2: Tensor) -> MegaWeights:
    e, two_i, h_half = w13.shape
    inter, hidden = two_i // 2, h_half * 2
    _require(two_i % 2 == 0, f"MXFP4 w13 {tuple(w13.shape)}: rows must be [gate; up] (even)")
    _require(
        w2.dtype in MXFP4_DTYPES, f"MXFP4 w2 must be packed uint8/int8 like w13, got {w2.dtype}"
    )
    _require(
        tuple(w2.shape) == (e, hidden, inter // 2),
        f"MXFP4 w2 has shape {tuple(w2.shape)}; w13 {tuple(w13.shape)} needs "
        f"{(e, hidden, inter // 2)}",
    )
    for name, s, want in (
        ("w13_scale", s13, (e, two_i, hidden // MXFP4_GROUP)),
        ("w2_scale", s2, (e, hidden, inter // MXFP4_GROUP)),
    ):
        _require(
            tuple(s.shape) == want, f"MXFP4 {name} has shape {tuple(s.shape)}, expected {want}"
        )
    _check_tiling(hidden, inter)
    sf13 = _transform_sf(deep_gemm, ue8m0_bytes(s13, "w13_scale"), two_i, hidden, e, "w13")
    sf2 = _transform_sf(deep_gemm, ue8m0_bytes(s2, "w2_scale"), hidden, inter, e, "w2")
    l1 = (
        interleave_gate_up(w13.view(torch.int8).contiguous()),
        utccp_transpose(interleave_gate_up(sf13)),
    )
    l2 = (w2.view(torch.int8).contiguous(), utccp_transpose(sf2))
    return l1, l2


def _build_fp8(deep_gemm: Any, w13: Tensor, w2: Tensor, s13: Tensor, s2: Tensor) -> MegaWeights:
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    _require(
        w2.dtype == torch.float8_e4m3fn, f"FP8 w2 must be float8_e4m3fn like w13, got {w2.dtype}"
    )
    _require(
        tuple(w2.shape) == (e, hidden, inter),
        f"FP8 w2 has shape {tuple(w2.shape)}; w13 {tuple(w13.shape)} needs {(e, hidden, inter)}",
    )
    _check_tiling(hidden, inter)
    for name, s, want in (
        ("w13_scale", s13, (e, two_i // FP8_BLOCK, hidden // FP8_BLOCK)),
        ("w2_scale", s2, (e, hidden // FP8_BLOCK, inter // FP8_BLOCK)),
    ):
        if tuple(s.shape) != want:
            raise MegaMoEFormatError(
                f"FP8 {name} has shape {tuple(s.shape)}; MegaMoE takes 128x128 block scales {want}"
            )
    # DeepGEMM's own transform (the rows of gate and up interleaved by 8, scales unchanged);
    # a GPU test checks it equals interleave_gate_up, which the fake kernel undoes.
    transform = resolve_entry_point(deep_gemm, "sm90_mega_moe_weights")
    l1, l2 = transform(
        (w13.contiguous(), s13.float().contiguous()), (w2.contiguous(), s2.float().contiguous())
    )
    return (l1[0], l1[1]), (l2[0], l2[1])


def build_mega_moe_experts_weights(
    deep_gemm: Any,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
) -> MegaWeights:
    """This rank's stacked experts (checkpoint layout, see the module docstring) -> the
    ``((l1, l1_sf), (l2, l2_sf))`` that ``FusedMoE.set_mega_weights`` takes. MXFP4 gives the
    Blackwell fp8xfp4 layout, FP8 128x128 the Hopper one. ``deep_gemm`` is the module (or a fake)
    whose ``transform_sf_into_required_layout`` lays out MXFP4 scales."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise MegaMoEWeightError(
            f"expert weights must be stacked [E, rows, cols], got w13 {tuple(w13.shape)}, w2 "
            f"{tuple(w2.shape)}"
        )
    if w13.dtype in MXFP4_DTYPES:
        fmt = "MXFP4"
    elif w13.dtype == torch.float8_e4m3fn:
        fmt = "FP8"
    else:
        raise MegaMoEFormatError(
            f"MegaMoE takes MXFP4 (packed uint8/int8) or FP8 (float8_e4m3fn, 128x128 block scales) "
            f"experts; these are {w13.dtype}"
        )
    if w13_scale is None or w2_scale is None:
        raise MegaMoEWeightError(f"{fmt} experts need both scales (w13_scale and w2_scale)")
    if fmt == "MXFP4":
        if not callable(getattr(deep_gemm, "transform_sf_into_required_layout", None)):
            raise MegaMoEWeightError(
                "the installed DeepGEMM has no transform_sf_into_required_layout()"
            )
        return _build_mxfp4(deep_gemm, w13, w2, w13_scale, w2_scale)
    return _build_fp8(deep_gemm, w13, w2, w13_scale, w2_scale)


def unbuild_mega_moe_experts_weights(mega: MegaWeights) -> UnbuiltExperts:
    """Inverse of :func:`build_mega_moe_experts_weights`: the checkpoint layout back (format told
    by the weight dtype: int8 -> MXFP4 with UE8M0 byte scales, e4m3 -> FP8 with block scales)."""
    (l1, l1_sf), (l2, l2_sf) = mega
    w13 = deinterleave_gate_up(l1)
    if l1.dtype == torch.float8_e4m3fn:
        return UnbuiltExperts("fp8", w13, l2, l1_sf, l2_sf)
    if l1.dtype not in MXFP4_DTYPES:
        raise MegaMoEWeightError(f"MegaMoE L1 weights must be packed FP4 or FP8, got {l1.dtype}")
    s13 = unpack_ue8m0_words(deinterleave_gate_up(utccp_untranspose(l1_sf)))
    s2 = unpack_ue8m0_words(utccp_untranspose(l2_sf))
    return UnbuiltExperts("mxfp4", w13.view(torch.uint8), l2.view(torch.uint8), s13, s2)
