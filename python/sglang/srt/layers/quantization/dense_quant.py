"""How a dense layer's checkpoint weight is quantised: the one fact a model hands to exactly the
layers whose weights ship quantised (DeepSeek V4: its attention projections, indexer ``wq_b`` and
shared expert, per the checkpoint's ``quantization_config``), through their build spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class DenseQuant:
    """``fp8_block``: e4m3 weights with one scale per ``block`` (rows x columns) tile, the scales
    UE8M0 or fp32 in the checkpoint (fp32 in memory); activations are quantised dynamically, one
    fp32 scale per ``act_group`` values of a row."""

    method: Literal["fp8_block"] = "fp8_block"
    block: tuple[int, int] = FP8_BLOCK
    act_group: int = 128

    def __post_init__(self) -> None:
        if self.method != "fp8_block":
            raise ValueError(f"unknown dense quantisation {self.method!r}")
        if tuple(self.block) != FP8_BLOCK or self.act_group != FP8_BLOCK[1]:
            raise ValueError(
                f"block-FP8 dense layers take {FP8_BLOCK} weight blocks and {FP8_BLOCK[1]}-value "
                f"activation groups, got {self.block} / {self.act_group}"
            )


FP8_BLOCK_QUANT = DenseQuant()
