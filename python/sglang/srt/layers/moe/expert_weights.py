"""Routed-expert weights as a rank keeps them resident, in every format a runner or kernel reads.

Formats (:class:`WeightFormat`, told by the weight dtype):
- ``bf16``: unquantised, in the model dtype (bf16, fp16 or fp32); ``w13 [E, 2I, H]``,
  ``w2 [E, H, I]``;
- ``fp8``: e4m3 of the same shapes with one fp32 scale per 128x128 block
  (``w13_scale [E, 2I/128, H/128]``, ``w2_scale [E, H/128, I/128]``);
- ``mxfp4``: two E2M1 values a byte (uint8 ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]``) and one
  UE8M0 byte per 32 values (uint8 ``w13_scale [E, 2I, H/32]``, ``w2_scale [E, H, I/32]``).

Layouts (:class:`ExpertLayout`): ``standard`` keeps ``w13`` as ``[gate; up]`` rows (rows
``[0, I)`` the gate projection, ``[I, 2I)`` the up projection), the layout of every runner.
``mega`` is DeepGEMM's MegaMoE layout (``mega_moe_weights``): MXFP4 for Blackwell's
``fp8_fp4_mega_moe`` (gate/up rows interleaved by 8, scales packed four to an int32 and
UTCCP-transposed) or FP8 for Hopper's ``fp8_mega_moe`` (rows interleaved, block scales as they
were). A layer whose experts run on that kernel keeps this one copy only; its fallback reads the
experts it needs from it on use (:meth:`ExpertWeights.select`).

Tensor parallelism slices the intermediate dimension of each expert (gate and up alike,
:meth:`ExpertWeights.shard`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights, unbuild_mega_moe_experts_weights
from sglang.srt.layers.quantization.mxfp4 import MXFP4_DTYPES, MXFP4_GROUP, dequant_mxfp4

FP8_BLOCK = (128, 128)
# Scale bytes UE8M0 may arrive as (checkpoints store uint8 or float8_e8m0fnu): the same bits.
UE8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
# Packed MXFP4 scales of the MegaMoE layout: four UE8M0 bytes an int32, 128 K values a word.
_MEGA_SF_VALUES = 4 * MXFP4_GROUP


class WeightFormat(str, enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    MXFP4 = "mxfp4"


class ExpertLayout(str, enum.Enum):
    STANDARD = "standard"
    MEGA = "mega"


def format_of(w: torch.Tensor) -> WeightFormat:
    """The format a weight tensor's dtype says: packed bytes are MXFP4, e4m3 is FP8."""
    if w.dtype in MXFP4_DTYPES:
        return WeightFormat.MXFP4
    if w.dtype == torch.float8_e4m3fn:
        return WeightFormat.FP8
    return WeightFormat.BF16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExpertWeights:
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    layout: ExpertLayout = ExpertLayout.STANDARD

    def __post_init__(self) -> None:
        fmt = format_of(self.w13)
        if format_of(self.w2) is not fmt:
            raise ValueError(
                f"expert weights mix formats: w13 is {self.w13.dtype}, w2 {self.w2.dtype}"
            )
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(
                f"expert weights must be stacked [E, rows, cols], got w13 "
                f"{tuple(self.w13.shape)}, w2 {tuple(self.w2.shape)}"
            )
        e, two_i = self.w13.shape[0], self.w13.shape[1]
        h, inter = self.hidden_size, self.intermediate_size
        if two_i != 2 * inter or tuple(self.w2.shape[:2]) != (e, h):
            raise ValueError(
                f"expert weights disagree: w13 {tuple(self.w13.shape)} needs w2 with {e} "
                f"experts, {h} rows and {two_i // 2} intermediate values a row, got "
                f"{tuple(self.w2.shape)} ({fmt.value})"
            )
        for name, s, want, dtypes in self._scale_specs(fmt, e, h, inter):
            got = None if s is None else tuple(s.shape)
            if want is None:
                if s is not None:
                    raise ValueError(f"{fmt.value} experts take no {name}, got shape {got}")
                continue
            if s is None or got != want:
                raise ValueError(
                    f"{fmt.value} {name[:-6]} of shape "
                    f"{tuple(getattr(self, name[:-6]).shape)} needs "
                    f"{'block ' if fmt is WeightFormat.FP8 else ''}scales {want}, got {got}"
                )
            if s.dtype not in dtypes:
                raise ValueError(f"{fmt.value} {name} must be {dtypes}, got {s.dtype}")
        if self.is_mega and fmt is WeightFormat.BF16:
            raise ValueError("bf16 experts have no MegaMoE layout")

    def _scale_specs(
        self, fmt: WeightFormat, e: int, h: int, inter: int
    ) -> list[tuple[str, torch.Tensor | None, tuple[int, ...] | None, tuple[torch.dtype, ...]]]:
        if fmt is WeightFormat.BF16:
            want13: tuple[int, ...] | None = None
            want2: tuple[int, ...] | None = None
            dtypes: tuple[torch.dtype, ...] = ()
        elif fmt is WeightFormat.FP8:
            b = FP8_BLOCK
            want13 = (e, _cdiv(2 * inter, b[0]), _cdiv(h, b[1]))
            want2 = (e, _cdiv(h, b[0]), _cdiv(inter, b[1]))
            dtypes = (torch.float32,)
        elif self.is_mega:
            want13 = (e, 2 * inter, h // _MEGA_SF_VALUES)
            want2 = (e, h, inter // _MEGA_SF_VALUES)
            dtypes = (torch.int32,)
        else:
            want13 = (e, 2 * inter, h // MXFP4_GROUP)
            want2 = (e, h, inter // MXFP4_GROUP)
            dtypes = (torch.uint8,)
        return [
            ("w13_scale", self.w13_scale, want13, dtypes),
            ("w2_scale", self.w2_scale, want2, dtypes),
        ]

    # --- what they are ----------------------------------------------------------------------

    @property
    def fmt(self) -> WeightFormat:
        return format_of(self.w13)

    @property
    def is_fp8(self) -> bool:
        return self.fmt is WeightFormat.FP8

    @property
    def is_mxfp4(self) -> bool:
        return self.fmt is WeightFormat.MXFP4

    @property
    def is_mega(self) -> bool:
        return self.layout is ExpertLayout.MEGA

    @property
    def _values_per_column(self) -> int:
        return 2 if self.is_mxfp4 else 1

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * self._values_per_column

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * self._values_per_column

    @property
    def block_shape(self) -> tuple[int, int] | None:
        return FP8_BLOCK if self.is_fp8 else None

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None)

    @property
    def nbytes(self) -> int:
        """Resident bytes (each storage once)."""
        seen: dict[int, int] = {}
        for t in self.tensors():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def describe(self) -> str:
        """``"mxfp4"``, ``"fp8 128x128"``, ``"bfloat16"``, with ``" (MegaMoE layout)"``."""
        if self.is_fp8:
            text = f"fp8 {FP8_BLOCK[0]}x{FP8_BLOCK[1]}"
        elif self.is_mxfp4:
            text = "mxfp4"
        else:
            text = str(self.w13.dtype).removeprefix("torch.")
        return text + (" (MegaMoE layout)" if self.is_mega else "")

    @property
    def mega_weights(self) -> MegaWeights:
        """``((l1, l1_sf), (l2, l2_sf))`` for DeepGEMM's MegaMoE kernel: the tensors themselves."""
        if not self.is_mega or self.w13_scale is None or self.w2_scale is None:
            raise ValueError(f"{self.describe()} experts are not in the MegaMoE layout")
        return (self.w13, self.w13_scale), (self.w2, self.w2_scale)

    @classmethod
    def from_mega(cls, mega: MegaWeights) -> ExpertWeights:
        """The experts a built MegaMoE layout holds, kept as they are (the one resident copy)."""
        (l1, l1_sf), (l2, l2_sf) = mega
        return cls(l1, l2, l1_sf, l2_sf, ExpertLayout.MEGA)

    # --- reading them -----------------------------------------------------------------------

    def standard(self) -> ExpertWeights:
        """The same experts in the standard layout (a copy when they are in the MegaMoE one)."""
        if not self.is_mega:
            return self
        back = unbuild_mega_moe_experts_weights(self.mega_weights)
        return ExpertWeights(back.w13, back.w2, back.w13_scale, back.w2_scale)

    def select(self, ids: torch.Tensor) -> ExpertWeights:
        """Experts ``ids`` (1-D) only, in the standard layout, format kept: what a runner reads
        when it computes only the experts a batch routed to."""
        ids = ids.to(device=self.device, dtype=torch.long)
        picked = [t.index_select(0, ids) for t in self.tensors()]
        return ExpertWeights(*picked, layout=self.layout).standard()  # type: ignore[misc]

    def unpacked(self, dtype: torch.dtype) -> ExpertWeights:
        """MXFP4 experts dequantised to ``dtype`` (exact in bf16, fp16 and fp32 for scales
        within their range); other formats unchanged."""
        if not self.is_mxfp4:
            return self
        s = self.standard()
        assert s.w13_scale is not None and s.w2_scale is not None
        return ExpertWeights(
            dequant_mxfp4(s.w13, s.w13_scale, dtype), dequant_mxfp4(s.w2, s.w2_scale, dtype)
        )

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in ``dtype``, standard layout: the reference view of whatever is stored."""
        s = self.standard()
        if s.is_fp8:
            assert s.w13_scale is not None and s.w2_scale is not None
            return (
                block_dequant_fp8(s.w13, s.w13_scale, FP8_BLOCK).to(dtype),
                block_dequant_fp8(s.w2, s.w2_scale, FP8_BLOCK).to(dtype),
            )
        u = s.unpacked(dtype)
        return u.w13.to(dtype), u.w2.to(dtype)

    # --- placing them -----------------------------------------------------------------------

    def experts(self, r: range) -> ExpertWeights:
        """Experts ``r.start .. r.stop - 1`` (views)."""
        return ExpertWeights(
            *(t[r.start : r.stop] for t in self.tensors()),  # type: ignore[misc]
            layout=self.layout,
        )

    def to(self, device: torch.device | str) -> ExpertWeights:
        return ExpertWeights(
            *(t.to(device) for t in self.tensors()),  # type: ignore[misc]
            layout=self.layout,
        )

    def shard(self, tp_rank: int, tp_size: int) -> ExpertWeights:
        """This rank's slice of the intermediate dimension (gate and up sliced alike), cut as
        stored: packed MXFP4 bytes and scales, or FP8 blocks, before any dequantisation."""
        if tp_size == 1:
            return self
        if self.is_mega:
            raise ValueError("MegaMoE-layout experts are whole on each rank; they cannot be sliced")
        inter = self.intermediate_size
        if inter % tp_size:
            raise ValueError(f"intermediate size {inter} is not divisible by tp size {tp_size}")
        part = inter // tp_size
        granule = {WeightFormat.BF16: 1, WeightFormat.FP8: FP8_BLOCK[0]}.get(self.fmt, MXFP4_GROUP)
        if part % granule:
            raise ValueError(
                f"{self.fmt.value} experts need intermediate/tp ({inter}/{tp_size}={part}) "
                f"divisible by {granule}"
            )
        lo, hi = tp_rank * part, (tp_rank + 1) * part

        def rows(t: torch.Tensor, per_row: int) -> torch.Tensor:
            # gate rows [lo, hi) and up rows [I + lo, I + hi), in units of ``per_row`` rows
            n = inter // per_row
            a, b = lo // per_row, hi // per_row
            return torch.cat([t[:, a:b], t[:, n + a : n + b]], dim=1).contiguous()

        def cols(t: torch.Tensor, per_col: int) -> torch.Tensor:
            return t[:, :, lo // per_col : hi // per_col].contiguous()

        if self.fmt is WeightFormat.BF16:
            return ExpertWeights(rows(self.w13, 1), cols(self.w2, 1))
        assert self.w13_scale is not None and self.w2_scale is not None
        if self.is_fp8:
            b = FP8_BLOCK[0]
            return ExpertWeights(
                rows(self.w13, 1),
                cols(self.w2, 1),
                rows(self.w13_scale, b),
                cols(self.w2_scale, b),
            )
        return ExpertWeights(
            rows(self.w13, 1),
            cols(self.w2, 2),
            rows(self.w13_scale, 1),
            cols(self.w2_scale, MXFP4_GROUP),
        )


def mxfp4_experts(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> ExpertWeights:
    """Packed MXFP4 experts as stored (uint8 or int8 bytes; UE8M0 scales as uint8 or
    float8_e8m0fnu), kept packed: the bytes are viewed as uint8, nothing is copied."""
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s.dtype not in UE8M0_DTYPES:
            raise TypeError(
                f"MXFP4 {name} must be UE8M0 bytes (uint8 or float8_e8m0fnu), got {s.dtype}"
            )
    return ExpertWeights(
        w13.view(torch.uint8),
        w2.view(torch.uint8),
        w13_scale.view(torch.uint8),
        w2_scale.view(torch.uint8),
    )


def expert_weights_from_checkpoint(
    fmt: WeightFormat | str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> ExpertWeights:
    """Runtime weights from stacked checkpoint tensors, dequantising MXFP4 to ``dtype``.

    - bf16: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in any float dtype (cast to ``dtype``);
    - fp8: e4m3 tensors of the same shapes with 128x128 block scales (kept FP8);
    - mxfp4: packed uint8 ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]`` with UE8M0 scales
      ``[E, 2I, H/32]`` / ``[E, H, I/32]``, dequantised to ``dtype`` (the exactness-check mode
      and the reference; :func:`mxfp4_experts` keeps them packed)."""
    fmt = WeightFormat(fmt)
    if fmt is WeightFormat.BF16:
        return ExpertWeights(w13.to(dtype), w2.to(dtype))
    if fmt is WeightFormat.FP8:
        if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
        return ExpertWeights(
            w13,
            w2,
            w13_scale.float() if w13_scale is not None else None,
            w2_scale.float() if w2_scale is not None else None,
        )
    if w13_scale is None or w2_scale is None:
        raise ValueError("MXFP4 experts need their UE8M0 scales (w13_scale and w2_scale)")
    return ExpertWeights(
        dequant_mxfp4(w13, w13_scale.view(torch.uint8), dtype),
        dequant_mxfp4(w2, w2_scale.view(torch.uint8), dtype),
    )


def stack_expert_tensors(
    gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors (w1=gate [I, H], w3=up [I, H], w2=down [H, I]) -> stacked
    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (works for packed and scale tensors alike)."""
    if not (len(gate) == len(up) == len(down)) or not gate:
        raise ValueError(
            "need the same non-zero number of gate/up/down tensors, got "
            f"{len(gate)}/{len(up)}/{len(down)}"
        )
    return torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)]), torch.stack(down)
