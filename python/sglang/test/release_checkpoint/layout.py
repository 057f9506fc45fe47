"""What a release checkpoint holds, tensor by tensor, and what its bytes are.

A model's writer describes every tensor it writes with a :class:`TensorSpec`: the logical name
and shape (what the tensor stands for once dequantised), the format it ships in, the byte group
it is counted in, how a rank's share of it is cut, and how the random writer draws it. The
writers turn the specs into files and record one :class:`TensorEntry` per file tensor; a
:class:`CheckpointLayout` sums them by group, whole or for one TP / EP rank.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


class Format(enum.Enum):
    """How a tensor is stored."""

    FP8_BLOCK = "fp8 e4m3 + power-of-two scale per 128x128 tile"
    MXFP4 = "mxfp4: two E2M1 a byte + UE8M0 scale per 32"
    PLAIN = "unquantised (bf16 / fp32)"
    INDEX = "integer table"


class Group(str, enum.Enum):
    """The byte groups of a checkpoint (a quantised tensor's scale is counted apart)."""

    EMBEDDINGS = "embeddings + lm head"
    DENSE_FP8 = "dense fp8"
    DENSE_FP8_SCALES = "dense fp8 scales"
    DENSE_PLAIN = "dense bf16/fp32"
    EXPERTS = "routed experts"
    EXPERT_SCALES = "routed expert scales"
    SMALL = "norms, biases, mHC, sinks"
    HASH_TABLES = "hash tables"
    NOT_LOADED = "not loaded (MTP, vision)"


SCALE_GROUP = {Group.DENSE_FP8: Group.DENSE_FP8_SCALES, Group.EXPERTS: Group.EXPERT_SCALES}


class Split(enum.Enum):
    """How the engine cuts a tensor over ranks (``CheckpointLayout.rank_bytes``)."""

    REPLICATED = "every rank holds it whole"
    TP = "cut over the TP ranks (column / row / head parallel)"
    SHARED_EXPERT = "cut over the TP ranks under a TP MoE, whole on every rank under EP"
    ROUTED_EXPERT = "num_experts / ep experts a rank, each cut over tp / ep ranks: 1/tp"
    NOT_LOADED = "no rank holds it (the loader skips it)"


@dataclass(frozen=True)
class Init:
    """How the random writer draws a tensor (fp32, then stored in the spec's format).

    ``fan_in``: N(0, gain^2 / K) for a [.., K] matrix; quantised matrices also get a factor
    2^U(-1, 1) per quantisation block, so the block scales really differ. ``normal``: N(a, b^2).
    ``uniform``: U(a, b). ``hash``: each row ``b`` distinct integers below ``a`` (a = the number
    of experts, b = top-k)."""

    kind: str
    a: float = 0.0
    b: float = 1.0


FAN_IN = Init("fan_in", b=1.0)
NORM = Init("uniform", 0.5, 1.5)  # RMSNorm weights
VECTOR = Init("normal", 0.0, 0.5)  # biases, sinks, mHC bases
MHC_SCALE = Init("normal", 1.0, 0.5)  # mHC scales around 1
EMBEDDING = Init("normal", 0.0, 1.0)  # rows of rms ~1, like the sublayer outputs


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of a release checkpoint.

    ``name`` and ``shape`` are the unquantised tensor's (the key of the writer's dequantised
    values). A quantised tensor is stored as ``stored_name`` (default ``name``) plus a scale
    ``scale_name``. Tensors with the same ``stack`` key (one projection of one layer's routed
    experts) are drawn and quantised together."""

    name: str
    shape: tuple[int, ...]
    fmt: Format
    group: Group
    split: Split
    init: Init = FAN_IN
    dtype: torch.dtype | None = None  # PLAIN / INDEX: stored dtype (None: the source's)
    stored_name: str | None = None
    scale_name: str | None = None
    scale_dtype: torch.dtype | None = None  # FP8: float8_e8m0fnu or float32; MXFP4: e8m0 / uint8
    packed_dtype: torch.dtype = torch.uint8  # MXFP4 bytes: uint8 or int8 (the same bits)
    stack: str | None = None

    @property
    def file_name(self) -> str:
        return self.stored_name or self.name

    def file_shapes(self) -> dict[str, tuple[int, ...]]:
        """The file tensors this spec becomes, with their shapes."""
        if self.fmt is Format.FP8_BLOCK:
            *lead, n, k = self.shape
            blocks = (*lead, -(-n // 128), -(-k // 128))
            return {self.file_name: self.shape, str(self.scale_name): blocks}
        if self.fmt is Format.MXFP4:
            *lead, k = self.shape
            return {self.file_name: (*lead, k // 2), str(self.scale_name): (*lead, k // 32)}
        return {self.file_name: self.shape}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as written: its file name, dtype, shape, bytes, group and split."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    group: Group
    split: Split


@dataclass(frozen=True, eq=False)
class CheckpointLayout:
    """Every file tensor of a checkpoint and the byte arithmetic over them."""

    entries: Mapping[str, TensorEntry]
    num_experts: int

    @classmethod
    def of(cls, entries: Mapping[str, TensorEntry], num_experts: int) -> CheckpointLayout:
        return cls(MappingProxyType(dict(entries)), num_experts)

    def bytes_by_group(self) -> dict[Group, int]:
        out = dict.fromkeys(Group, 0)
        for e in self.entries.values():
            out[e.group] += e.nbytes
        return {g: b for g, b in out.items() if b}

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def rank_bytes(self, tp_size: int = 1, ep_size: int = 1) -> dict[Group, int]:
        """The file bytes one rank of ``--tp-size tp_size --ep-size ep_size`` holds, by group:
        replicated tensors whole, TP-cut tensors 1/tp (rounded up), shared experts 1/tp under a
        TP MoE and whole under EP, routed experts 1/tp (num_experts / ep experts, each cut over
        tp / ep ranks), skipped tensors (MTP, vision) not at all. Attention is plain TP (no DP
        attention)."""
        if tp_size < 1 or ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"ep_size {ep_size} must divide tp_size {tp_size} (both >= 1)")
        if self.num_experts % ep_size:
            raise ValueError(f"{self.num_experts} routed experts do not split over {ep_size} ranks")
        out = dict.fromkeys(Group, 0)
        for e in self.entries.values():
            if e.split is Split.NOT_LOADED:
                continue
            cut = e.split in (Split.TP, Split.ROUTED_EXPERT) or (
                e.split is Split.SHARED_EXPERT and ep_size == 1
            )
            out[e.group] += -(-e.nbytes // tp_size) if cut else e.nbytes
        return {g: b for g, b in out.items() if b}

    def rank_total_bytes(self, tp_size: int = 1, ep_size: int = 1) -> int:
        return sum(self.rank_bytes(tp_size, ep_size).values())

    def format_table(self, tp_size: int = 1, ep_size: int = 1) -> str:
        """Bytes per group, whole and one rank's share, as a markdown table."""
        whole, rank = self.bytes_by_group(), self.rank_bytes(tp_size, ep_size)
        share = f"rank of tp{tp_size}" + (f" ep{ep_size}" if ep_size > 1 else "")
        lines = [
            f"| group | tensors | file bytes | {share} |",
            "|---|---:|---:|---:|",
        ]
        counts = dict.fromkeys(Group, 0)
        for e in self.entries.values():
            counts[e.group] += 1
        for g, b in whole.items():
            lines.append(f"| {g.value} | {counts[g]} | {_gib(b)} | {_gib(rank.get(g, 0))} |")
        lines.append(
            f"| total | {len(self.entries)} | {_gib(self.total_bytes())} | "
            f"{_gib(sum(rank.values()))} |"
        )
        return "\n".join(lines)


def _gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.3f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n} B"
