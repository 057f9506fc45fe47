"""Which MoE path is fastest at a size: measured times per (expert shape, dtype, device, M bucket).

Paths: ``triton`` (our fused-MoE kernels; they pick two-launch or the Hopper TMA kernels per size
from their own tables), ``triton_mega`` (our Triton MegaMoE), ``deep_gemm_contiguous`` /
``deep_gemm_masked`` (the ``deep_gemm`` runner's layouts), ``deep_gemm_mega`` (DeepGEMM's SM90
MegaMoE). One JSON table per (expert shape E, H, I, top-k; weight dtype; GPU) in
``path_tables/``, named ``E{E}_H{H}_I{I}_top{k}_{dtype}_{device}.json`` like the fused-MoE
tile tables, written by ``scripts/tune_moe_paths.py`` (which measures every path at every size
``scripts/bench_moe.py`` covers, each the way the engine runs it: under CUDA-graph replay at
decode sizes, eagerly at prefill sizes and always for the contiguous layout, which reads its
size back to the host). A batch of M tokens reads the bucket with the largest ``m <= M`` (the
smallest bucket below all of them).

A shape without its own table (another model, a TP or EP slice of the experts) reads the
nearest measured shape of the same dtype on the same GPU (closest in ``H * I`` and in rows an
expert gets, ``top_k / E``, both on a log scale) at the token count that gives its experts the
same rows each: ``M * (k / E) * (E' / k')``. The choice then follows the work per expert and the
GEMM sizes, not the token count alone. These are one-GPU numbers: callers apply them only where
the paths do the same work (no expert parallelism).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sglang.kernels.ops.moe import tuned_configs
from sglang.srt.utils.log import get_logger, log_once

if TYPE_CHECKING:
    from sglang.srt.layers.moe.expert_weights import ExpertWeights

logger = get_logger(__name__)

TABLE_DIR = Path(__file__).parent / "path_tables"
# The tables measured so far are the H200's; any other GPU without its own reads these.
DEFAULT_DEVICE = "NVIDIA H200"


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int


DSV4 = MoeShape(256, 6, 4096, 2048)
K3 = MoeShape(384, 16, 3584, 3072)

_T, _MEGA, _DGC, _DGM, _DGMEGA = (
    "triton",
    "triton_mega",
    "deep_gemm_contiguous",
    "deep_gemm_masked",
    "deep_gemm_mega",
)
PATHS = (_T, _MEGA, _DGC, _DGM, _DGMEGA)

Buckets = dict[int, dict[str, float]]  # M -> {path: us}


def table_name(shape: MoeShape, dtype: str, device: str) -> str:
    """The file name of a shape's table: the tuned kernel tables' naming."""
    return tuned_configs.table_name(
        shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, device
    )


def write_table(
    shape: MoeShape, dtype: str, device: str, buckets: Buckets, source: str, out_dir: Path
) -> Path:
    """Write one table (``scripts/tune_moe_paths.py``); returns its path."""
    data = {
        "device": device,
        "shape": {"experts": shape.experts, "top_k": shape.top_k, "hidden": shape.hidden,
                  "inter": shape.inter},
        "dtype": dtype,
        "source": source,
        "buckets": [
            {"m": m, "us": {p: round(us, 1) for p, us in sorted(t.items())}}
            for m, t in sorted(buckets.items())
        ],
    }  # fmt: skip
    path = out_dir / table_name(shape, dtype, device)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_table(path: Path) -> tuple[MoeShape, str, str, Buckets]:
    """(shape, dtype, device, buckets) of one table file."""
    data = json.loads(path.read_text())
    s = data["shape"]
    shape = MoeShape(int(s["experts"]), int(s["top_k"]), int(s["hidden"]), int(s["inter"]))
    buckets = {int(b["m"]): {p: float(us) for p, us in b["us"].items()} for b in data["buckets"]}
    return shape, str(data["dtype"]), str(data["device"]), buckets


@functools.cache
def load_tables(table_dir: Path = TABLE_DIR) -> dict[tuple[MoeShape, str, str], Buckets]:
    """Every stored table, by (shape, dtype, device)."""
    tables = {}
    for path in sorted(table_dir.glob("*.json")):
        shape, dtype, device, buckets = read_table(path)
        tables[(shape, dtype, device)] = buckets
    return tables


def current_device_name() -> str:
    """The GPU whose tables apply: this process's CUDA device, else the default."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return DEFAULT_DEVICE


def _device_tables(dtype: str, device: str | None) -> dict[MoeShape, Buckets]:
    tables = load_tables()
    name = device or current_device_name()
    if not any(d == name for (_, _, d) in tables):
        name = DEFAULT_DEVICE
    return {s: b for (s, dt, d), b in tables.items() if dt == dtype and d == name}


def _pick(buckets: Buckets, m: int) -> tuple[int, dict[str, float]]:
    return tuned_configs.pick_bucket(sorted(buckets.items()), m)


def bucket_times(
    shape: MoeShape, dtype: str, m: int, device: str | None = None
) -> tuple[int, dict[str, float]] | None:
    """The measured bucket of this exact shape that a batch of ``m`` tokens reads, or None
    (this shape was not measured)."""
    buckets = _device_tables(dtype, device).get(shape)
    return _pick(buckets, m) if buckets else None


def _distance(a: MoeShape, b: MoeShape) -> float:
    size = abs(math.log((a.hidden * a.inter) / (b.hidden * b.inter)))
    rows = abs(math.log((a.top_k / a.experts) / (b.top_k / b.experts)))
    return size + rows


def nearest_bucket_times(
    shape: MoeShape, dtype: str, m: int, device: str | None = None
) -> tuple[MoeShape, int, int, dict[str, float]] | None:
    """(the table's shape, the token count read there, its bucket, the times) for ``m`` tokens
    of ``shape``: its own table, else the nearest measured shape's at the same rows an expert
    (module docstring); None when nothing of this dtype was measured."""
    tables = _device_tables(dtype, device)
    if not tables:
        return None
    if shape in tables:
        return (shape, m, *_pick(tables[shape], m))
    near = min(tables, key=lambda s: (_distance(shape, s), s.experts, s.hidden))
    m_near = max(1, round(m * (shape.top_k / shape.experts) * (near.experts / near.top_k)))
    return (near, m_near, *_pick(tables[near], m_near))


def fastest_path(
    shape: MoeShape, dtype: str, m: int, candidates: Iterable[str], device: str | None = None
) -> tuple[str, str] | None:
    """The fastest measured path among ``candidates`` at ``m`` tokens of ``shape`` (its own
    table or the nearest shape's, :func:`nearest_bucket_times`) and why, or None when none of
    them was measured there (the caller keeps its own default)."""
    found = nearest_bucket_times(shape, dtype, m, device)
    if found is None:
        return None
    table_shape, m_read, bucket, times = found
    timed = {p: times[p] for p in candidates if p in times}
    if not timed:
        return None
    best = min(timed, key=lambda p: timed[p])
    others = ", ".join(f"{p} {us:.0f}" for p, us in sorted(timed.items()) if p != best)
    where = f"M bucket {bucket}"
    if table_shape != shape:
        where = (
            f"the nearest measured shape E={table_shape.experts} top-{table_shape.top_k} "
            f"H={table_shape.hidden} I={table_shape.inter} at M={m_read} (same rows an expert), "
            f"bucket {bucket}"
        )
    return best, f"{where}: {best} {timed[best]:.0f} us (measured; {others or 'alone'})"


def mega_moe_measured_slower(
    shape: MoeShape, dtype: str, m: int, mega_path: str = _MEGA
) -> str | None:
    """Why the MegaMoE kernel ``mega_path`` should not take ``m`` tokens: a reason when it
    measured slower than the fastest non-mega path at that bucket of this very shape, else None
    (also when it was not measured there: the user's choice stands)."""
    found = bucket_times(shape, dtype, m)
    if found is None or mega_path not in found[1]:
        return None
    bucket, times = found
    normal = {p: us for p, us in times.items() if p not in (_MEGA, _DGMEGA)}
    if not normal:
        return None
    best = min(normal, key=lambda p: normal[p])
    if times[mega_path] <= normal[best]:
        return None
    return (
        f"{mega_path} measured {times[mega_path]:.0f} us against {best} {normal[best]:.0f} us "
        f"at M bucket {bucket} ({dtype}, E={shape.experts} top-{shape.top_k} H={shape.hidden} "
        f"I={shape.inter})"
    )


def dtype_key(dtype: torch.dtype) -> str:
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def shape_of(weights: ExpertWeights, top_k: int) -> MoeShape:
    return MoeShape(weights.num_experts, top_k, weights.hidden_size, weights.intermediate_size)


def log_choice(what: str, why: str) -> None:
    """One log line per distinct choice (a bucket's choice is the same for every batch in it)."""
    log_once(logger, logging.INFO, f"MoE path {what}: {why}")
