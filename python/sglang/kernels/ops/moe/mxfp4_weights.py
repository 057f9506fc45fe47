"""Resident MXFP4 expert weights for the W4A16 fused MoE (``fused_moe_mxfp4.py``), in the layouts
its kernels read.

All layouts keep the checkpoint's 4-bit bytes and UE8M0 scales (resident bytes = checkpoint bytes):
- **plain** (the checkpoint): ``w13`` uint8/int8 ``[E, 2I, H/2]`` (rows ``[gate; up]``), ``w2``
  ``[E, H, I/2]``, scales one byte per 32 values ``[E, 2I, H/32]`` / ``[E, H, I/32]`` (uint8 or
  float8_e8m0fnu). The kernel reads the scale bytes four at a time as int32 words, so K must be a
  multiple of 128 (every DeepSeek V4 / Kimi K3 width is).
- **prepared** (:func:`prepare_mxfp4_moe_weights`): the same weight bytes, scales as int32 words of
  four UE8M0 bytes along K (the lowest byte the first group), stored MN-major (``[E, N, K/128]``
  with stride 1 along N): the scales of a tile of rows are one contiguous run, read in 16-byte
  loads instead of one 4-byte load a row.
- **MegaMoE** (:func:`mega_moe_mxfp4_weights`): DeepGEMM's SM100 ``fp8_fp4_mega_moe`` layout,
  read in place (on Blackwell these bytes are the only copy): ``w13`` rows interleaved gate/up in
  granules of :data:`GATE_UP_GRANULE`, scales as MN-major int32 words whose rows are interleaved
  the same way and then UTCCP-transposed within each 128-row block (:func:`utccp_storage_row`).

The layout is described by :class:`Mxfp4Layout` (constexpr flags of the kernels) and carried by
:class:`Mxfp4MoeWeights`, whose :meth:`~Mxfp4MoeWeights.dequantized` view (the plain ``[gate; up]``
rows in bf16) is what references and tests compare against. The MegaMoE constants are defined here
(kernels never import the engine); ``srt/layers/moe/mega_moe_weights.py`` builds that layout with
DeepGEMM and imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from sglang.kernels.ops.quant.mxfp4 import (
    MXFP4_DTYPES,
    MXFP4_GROUP,
    UE8M0_DTYPES,
    dequant_mxfp4,
)

GATE_UP_GRANULE = 8  # MegaMoE L1 rows: 8 gate rows, then the 8 up rows of the same columns
UTCCP_BLOCK = (4, 32)  # a 128-row scale block is read as 4 x 32 rows, transposed to 32 x 4
UTCCP_ROWS = UTCCP_BLOCK[0] * UTCCP_BLOCK[1]
SF_PER_WORD = 4  # UE8M0 bytes packed into one int32 scale word along K
K_PER_WORD = SF_PER_WORD * MXFP4_GROUP  # 128 values of K share one scale word


@dataclass(frozen=True)
class Mxfp4Layout:
    """How the experts' rows and scales are laid out (the kernels' constexpr layout flags).

    ``gate_up_granule``: 0 when ``w13`` rows are ``[gate; up]`` halves; G when gate and up rows
    alternate in runs of G (gate rows of columns ``[G*j, G*j+G)`` at rows ``[2*G*j, 2*G*j+G)``,
    their up rows right after). ``scale_utccp``: each 128-row block of scale rows is stored 4 x 32
    transposed (:func:`utccp_storage_row`)."""

    gate_up_granule: int = 0
    scale_utccp: bool = False

    def __post_init__(self) -> None:
        if self.gate_up_granule < 0:
            raise ValueError(f"gate_up_granule must be >= 0, got {self.gate_up_granule}")


PLAIN_LAYOUT = Mxfp4Layout()
MEGA_MOE_LAYOUT = Mxfp4Layout(gate_up_granule=GATE_UP_GRANULE, scale_utccp=True)


def gate_up_rows(inter: int, granule: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [2I]: the stored row of each plain ``[gate; up]`` row (identity for granule 0)."""
    n = torch.arange(inter, device=device)
    if granule == 0:
        return torch.arange(2 * inter, device=device)
    gate = (n // granule) * (2 * granule) + n % granule
    return torch.cat([gate, gate + granule])


def utccp_storage_row(rows: torch.Tensor) -> torch.Tensor:
    """Where a scale row is stored under the UTCCP transpose: row ``i*32 + j`` of a 128-row block
    sits at ``j*4 + i`` of the same block."""
    a, b = UTCCP_BLOCK
    within = rows % UTCCP_ROWS
    return rows - within + (within % b) * a + within // b


def scale_words(scale: torch.Tensor, what: str) -> torch.Tensor:
    """UE8M0 scales as int32 words ``[..., N, K/128]`` (no copy): byte scales ``[..., N, K/32]``
    (uint8 / float8_e8m0fnu, last dim contiguous) are viewed four to a word; int32 words pass."""
    if scale.dtype == torch.int32:
        return scale
    if scale.dtype not in UE8M0_DTYPES:
        raise TypeError(
            f"{what}: MXFP4 scales must be UE8M0 bytes (uint8 / float8_e8m0fnu) or int32 words of "
            f"four, got {scale.dtype}"
        )
    groups = scale.shape[-1]
    if groups % SF_PER_WORD or scale.stride(-1) != 1:
        raise ValueError(
            f"{what}: byte scales {tuple(scale.shape)} are read {SF_PER_WORD} to an int32 word, so "
            f"K must be a multiple of {K_PER_WORD} and the last dim contiguous "
            f"(stride {scale.stride(-1)})"
        )
    return scale.view(torch.uint8).view(torch.int32)


def word_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., N, K/128]`` words (any strides) -> uint8 ``[..., N, K/32]`` (a copy)."""
    row_major = torch.empty(words.shape, dtype=torch.int32, device=words.device).copy_(words)
    return row_major.view(torch.uint8)


def scale_byte_view(scale: torch.Tensor, what: str) -> torch.Tensor:
    """UE8M0 scales as uint8 ``[..., N, K/128, 4]`` (no copy, any strides but the last): the four
    bytes of each word, lowest (the first group of 32) first."""
    words = scale_words(scale, what)
    if scale.dtype != torch.int32:  # bytes with a contiguous last dim: a plain view
        return scale.view(torch.uint8).unflatten(-1, (-1, SF_PER_WORD))
    byte_strides = (*(st * SF_PER_WORD for st in words.stride()), 1)
    out = torch.empty(0, dtype=torch.uint8, device=words.device)
    return out.set_(
        words.untyped_storage(),
        words.storage_offset() * SF_PER_WORD,
        (*words.shape, SF_PER_WORD),
        byte_strides,
    )


@dataclass(frozen=True)
class Mxfp4MoeWeights:
    """One layer's (or rank's) routed experts in MXFP4, as the W4A16 kernels read them.

    ``w13`` uint8/int8 ``[E, 2I, H/2]``, ``w2`` ``[E, H, I/2]``, scales as UE8M0 bytes
    ``[E, N, K/32]`` or int32 words ``[E, N, K/128]`` (any strides), laid out as ``layout`` says."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    layout: Mxfp4Layout = PLAIN_LAYOUT

    def __post_init__(self) -> None:
        check_mxfp4_experts(self.w13, self.w2, self.w13_scale, self.w2_scale, self.layout)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def nbytes(self) -> int:
        """Resident bytes (weights and scales)."""
        tensors = (self.w13, self.w2, self.w13_scale, self.w2_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    @cached_property
    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the kernels take: packed weights as uint8 ``[E, N, K/2]`` and scales as uint8
        ``[E, N, K/128, 4]`` (the bytes of each scale word); views, no copies, made once."""
        return (
            self.w13.view(torch.uint8),
            self.w2.view(torch.uint8),
            scale_byte_view(self.w13_scale, "w13_scale"),
            scale_byte_view(self.w2_scale, "w2_scale"),
        )

    @cached_property
    def scale_word_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales as the split kernel reads them: int32 words ``[E, N, K/128]`` (four UE8M0
        bytes along K, the first group lowest; any strides); views, no copies, made once."""
        return scale_words(self.w13_scale, "w13_scale"), scale_words(self.w2_scale, "w2_scale")

    def plain_scales(
        self, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """UE8M0 bytes ``[E', 2I, H/32]`` / ``[E', H, I/32]`` in the plain row order."""
        s13 = scale_words(self.w13_scale, "w13_scale")
        s2 = scale_words(self.w2_scale, "w2_scale")
        if experts is not None:
            s13, s2 = s13[experts], s2[experts]
        dev = s13.device
        rows13 = gate_up_rows(self.inter, self.layout.gate_up_granule, dev)
        rows2 = torch.arange(self.hidden, device=dev)
        if self.layout.scale_utccp:
            rows13, rows2 = utccp_storage_row(rows13), utccp_storage_row(rows2)
        return word_bytes(s13[:, rows13]), word_bytes(s2[:, rows2])

    def plain_weights(
        self, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed bytes uint8 ``[E', 2I, H/2]`` / ``[E', H, I/2]`` in the plain row order."""
        w13, w2 = self.w13.view(torch.uint8), self.w2.view(torch.uint8)
        if experts is not None:
            w13, w2 = w13[experts], w2[experts]
        rows13 = gate_up_rows(self.inter, self.layout.gate_up_granule, w13.device)
        return w13[:, rows13], w2

    def dequantized(
        self, dtype: torch.dtype = torch.bfloat16, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts (all, or those listed in ``experts``) as ``dtype`` weights in the plain
        layout: ``w13`` ``[E', 2I, H]`` rows ``[gate; up]`` and ``w2`` ``[E', H, I]``. Exact in bf16
        (every E2M1 value times a power of two in bf16's range is a bf16 value)."""
        w13, w2 = self.plain_weights(experts)
        s13, s2 = self.plain_scales(experts)
        return dequant_mxfp4(w13, s13, dtype), dequant_mxfp4(w2, s2, dtype)


def check_mxfp4_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    layout: Mxfp4Layout,
) -> None:
    """Shapes, dtypes and the K / row tiling the kernels need; raises ``ValueError`` /
    ``TypeError`` naming the tensor."""
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype not in MXFP4_DTYPES:
            raise TypeError(f"{name}: MXFP4 weights are packed uint8/int8 bytes, got {w.dtype}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be [E, rows, K/2], got {tuple(w.shape)}")
        if w.stride(-1) != 1 or w.shape[-1] % SF_PER_WORD:
            raise ValueError(
                f"{name} {tuple(w.shape)}: packed rows are read as int32 words, so the last dim "
                f"must be contiguous and a multiple of 4 bytes"
            )
    e, two_i, h_half = w13.shape
    inter, hidden = two_i // 2, 2 * h_half
    if two_i % 2 or tuple(w2.shape) != (e, hidden, inter // 2):
        raise ValueError(
            f"MXFP4 experts: w13 {tuple(w13.shape)} ([E, 2I, H/2]) and w2 {tuple(w2.shape)} "
            f"([E, H, I/2]) do not agree"
        )
    for name, value in (("hidden", hidden), ("intermediate", inter)):
        if value % K_PER_WORD:
            raise ValueError(
                f"the MXFP4 kernels read scales {SF_PER_WORD} to a word along K: the expert {name} "
                f"size ({value}) must be a multiple of {K_PER_WORD}"
            )
    if layout.gate_up_granule and inter % layout.gate_up_granule:
        raise ValueError(
            f"intermediate size {inter} is not whole gate/up granules of {layout.gate_up_granule}"
        )
    if layout.scale_utccp and (two_i % UTCCP_ROWS or hidden % UTCCP_ROWS):
        raise ValueError(f"UTCCP scales need row counts that are multiples of {UTCCP_ROWS}")
    for name, s, rows, k in (
        ("w13_scale", w13_scale, two_i, hidden),
        ("w2_scale", w2_scale, hidden, inter),
    ):
        if s.dtype == torch.int32:
            want = (e, rows, k // K_PER_WORD)
        elif s.dtype in UE8M0_DTYPES:
            want = (e, rows, k // MXFP4_GROUP)
        else:
            raise TypeError(
                f"{name}: MXFP4 scales must be UE8M0 bytes (uint8 / float8_e8m0fnu) or int32 "
                f"words, got {s.dtype}"
            )
        if tuple(s.shape) != want:
            raise ValueError(f"{name} has shape {tuple(s.shape)}, expected {want} ({s.dtype})")
    devices = {t.device for t in (w13, w2, w13_scale, w2_scale)}
    if len(devices) != 1:
        raise ValueError(
            f"MXFP4 expert tensors are on different devices: {sorted(map(str, devices))}"
        )


def prepare_mxfp4_moe_weights(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> Mxfp4MoeWeights:
    """Checkpoint layout -> the prepared resident layout (once, at load): the weight bytes as they
    are (made contiguous), the scales as MN-major int32 words (a tile's scales contiguous). Same
    resident bytes as the checkpoint."""
    check_mxfp4_experts(w13, w2, w13_scale, w2_scale, PLAIN_LAYOUT)

    def mn_major(s: torch.Tensor, what: str) -> torch.Tensor:
        words = scale_words(s.contiguous() if s.dtype != torch.int32 else s, what)
        e, n, kw = words.shape
        out = torch.empty((e, kw, n), dtype=torch.int32, device=words.device).transpose(1, 2)
        return out.copy_(words)

    return Mxfp4MoeWeights(
        w13.contiguous(),
        w2.contiguous(),
        mn_major(w13_scale, "w13_scale"),
        mn_major(w2_scale, "w2_scale"),
        PLAIN_LAYOUT,
    )


def mega_moe_mxfp4_weights(
    l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor]
) -> Mxfp4MoeWeights:
    """Wrap DeepGEMM MegaMoE MXFP4 weights ``((w13, sf13), (w2, sf2))`` (int8 weights, int32
    MN-major UTCCP scale words) for the W4A16 kernels, without copying."""
    (w13, sf13), (w2, sf2) = l1, l2
    for name, sf in (("l1 scales", sf13), ("l2 scales", sf2)):
        if sf.dtype != torch.int32:
            raise TypeError(f"MegaMoE {name} are int32 words of four UE8M0 bytes, got {sf.dtype}")
    return Mxfp4MoeWeights(w13, w2, sf13, sf2, MEGA_MOE_LAYOUT)


def mega_moe_layout_of(weights: Mxfp4MoeWeights) -> Mxfp4MoeWeights:
    """The same experts re-laid out in the MegaMoE layout (torch, for tests and tools; the engine
    builds it with DeepGEMM): rows interleaved gate/up by 8, scale words MN-major, UTCCP."""
    w13, w2 = weights.plain_weights()
    s13, s2 = weights.plain_scales()
    inter = weights.inter
    interleave = torch.argsort(gate_up_rows(inter, GATE_UP_GRANULE, w13.device))
    w13_i = w13[:, interleave].contiguous()

    def words(s: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        packed = s.contiguous().view(torch.int32)
        if rows is not None:
            packed = packed[:, rows]
        order = torch.argsort(utccp_storage_row(torch.arange(packed.shape[1], device=s.device)))
        packed = packed[:, order]
        e, n, kw = packed.shape
        out = torch.empty((e, kw, n), dtype=torch.int32, device=s.device).transpose(1, 2)
        return out.copy_(packed)

    return Mxfp4MoeWeights(
        w13_i.view(torch.int8),
        w2.contiguous().view(torch.int8),
        words(s13, interleave),
        words(s2, None),
        MEGA_MOE_LAYOUT,
    )
