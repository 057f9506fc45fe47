"""Bytes of a rank's weights by layer, group and format: what is resident, and what the checkpoint
holds of this rank's share, in one shape so the two compare per layer and for the whole model.

Groups: ``attention`` (every attention projection and its norms), ``shared_experts``,
``routed_experts``, ``embeddings_head`` and ``other`` (routers, mHC / AttnRes parameters, norms
outside attention, dense MLPs, latent projections). Formats are short names: ``bf16``,
``fp32``, ``fp8`` (e4m3 with its fp32 block scales), ``mxfp4``, ``int32`` ... as the tensors
hold them. The memory budget (``model_executor/memory_budget.py``) logs the resident bytes per
format; the loader logs both and their ratio per layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

GROUPS = ("attention", "shared_experts", "routed_experts", "embeddings_head", "other")


def human_bytes(n: float) -> str:
    """``"1.50 GiB"``, ``"12.0 MiB"``, ``"512 B"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class WeightBytes:
    """``(layer or None, group, format) -> bytes``; ``layer`` None for model-level tensors."""

    entries: Mapping[tuple[int | None, str, str], int] = field(default_factory=dict)

    @classmethod
    def of(cls, items: Iterable[tuple[int | None, str, str, int]]) -> WeightBytes:
        acc: dict[tuple[int | None, str, str], int] = defaultdict(int)
        for layer, group, fmt, nbytes in items:
            if group not in GROUPS:
                raise ValueError(f"unknown weight group {group!r}; expected one of {GROUPS}")
            acc[(layer, group, fmt)] += int(nbytes)
        return cls(dict(acc))

    def __add__(self, other: WeightBytes) -> WeightBytes:
        return WeightBytes.of((*k, v) for part in (self, other) for k, v in part.entries.items())

    def only(self, *groups: str) -> WeightBytes:
        """The entries of ``groups`` alone."""
        return WeightBytes({k: v for k, v in self.entries.items() if k[1] in groups})

    def total(self) -> int:
        return sum(self.entries.values())

    def layers(self) -> list[int]:
        return sorted({layer for layer, _, _ in self.entries if layer is not None})

    def of_layer(self, layer: int | None) -> int:
        return sum(v for (lay, _, _), v in self.entries.items() if lay == layer)

    def by_group(self) -> dict[str, dict[str, int]]:
        """group -> format -> bytes, groups in :data:`GROUPS` order."""
        out: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
        for (_, group, fmt), v in self.entries.items():
            out[group][fmt] = out[group].get(fmt, 0) + v
        return {g: f for g, f in out.items() if f}

    def by_format(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, _, fmt), v in self.entries.items():
            out[fmt] = out.get(fmt, 0) + v
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def describe(self) -> str:
        """``"12.31 GiB: routed_experts mxfp4 10.20 GiB; attention bf16 1.80 GiB; ..."``."""
        parts = [
            f"{group} {fmt} {human_bytes(v)}"
            for group, fmts in self.by_group().items()
            for fmt, v in sorted(fmts.items(), key=lambda kv: -kv[1])
        ]
        return f"{human_bytes(self.total())}: " + "; ".join(parts)


@dataclass(frozen=True)
class BytesRatio:
    """Resident against checkpoint bytes for one layer (``layer`` None: the whole model)."""

    layer: int | None
    resident: int
    checkpoint: int

    @property
    def ratio(self) -> float:
        return self.resident / self.checkpoint if self.checkpoint else float("inf")


def resident_vs_checkpoint(resident: WeightBytes, checkpoint: WeightBytes) -> list[BytesRatio]:
    """One :class:`BytesRatio` per decoder layer either side has, then the model-level tensors
    (``layer`` None would be ambiguous, so they join the whole model's line only), last the whole
    model (``layer`` None)."""
    rows = [
        BytesRatio(layer, resident.of_layer(layer), checkpoint.of_layer(layer))
        for layer in sorted(set(resident.layers()) | set(checkpoint.layers()))
    ]
    rows.append(BytesRatio(None, resident.total(), checkpoint.total()))
    return rows
