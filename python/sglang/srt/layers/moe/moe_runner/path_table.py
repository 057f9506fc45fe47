"""Which MoE path is fastest at a size: measured times per (expert shape, dtype, M bucket).

Paths: ``triton`` (our fused-MoE kernels; they pick two-launch or the Hopper TMA kernels per size
from their own tables), ``triton_mega`` (our Triton MegaMoE), ``deep_gemm_contiguous`` /
``deep_gemm_masked`` (the ``deep_gemm`` runner's layouts), ``deep_gemm_mega`` (DeepGEMM's SM90
MegaMoE). Times are microseconds on one H200 under CUDA-graph replay (contiguous: eager, it reads
its size back to the host), uniform random routing, from the runs named in ``docs/performance.md``:
``triton`` at 1 and 128-8192 from ``scripts/bench_moe_prefill.py`` (on this table's
kernels and tiles), at 8 and 32 and the DeepGEMM layouts from ``scripts/bench_moe.py``,
``triton_mega`` from ``shared/design/performance_targets.md``, ``deep_gemm_mega`` from
``scripts/bench_deep_gemm_mega_moe.py``. A batch of M tokens reads the bucket with the largest
``m <= M`` (the smallest bucket below all of them). These are one-GPU numbers: callers apply them
only where the paths do the same work (no expert parallelism).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.utils.log import get_logger, log_once

if TYPE_CHECKING:
    from sglang.srt.layers.moe.expert_weights import ExpertWeights

logger = get_logger(__name__)


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

# (shape, dtype) -> {M: {path: us}}
MEASURED_US: dict[tuple[MoeShape, str], dict[int, dict[str, float]]] = {
    (DSV4, "bf16"): {
        1: {_T: 80, _MEGA: 81, _DGM: 214, _DGC: 892},
        8: {_T: 512, _DGM: 673, _DGC: 1276},
        32: {_T: 1538, _DGM: 1857, _DGC: 2796},
        128: {_T: 2724, _MEGA: 2716, _DGM: 3283, _DGC: 4521},
        512: {_T: 2896, _MEGA: 3066, _DGM: 3773, _DGC: 4569},
        2048: {_T: 3174, _MEGA: 4641, _DGM: 5263, _DGC: 4527},
        8192: {_T: 5931, _MEGA: 10030, _DGC: 6279},
    },
    (DSV4, "fp8"): {
        1: {_T: 51, _MEGA: 59, _DGM: 275, _DGC: 1289, _DGMEGA: 91.2},
        8: {_T: 283, _DGM: 523, _DGC: 1917, _DGMEGA: 302.9},
        32: {_T: 819, _DGM: 1124, _DGC: 2004, _DGMEGA: 879.6},
        128: {_T: 1449, _MEGA: 1471, _DGM: 1990, _DGC: 3009, _DGMEGA: 1537.9},
        512: {_T: 1615, _MEGA: 1909, _DGM: 2906, _DGC: 2844, _DGMEGA: 1912.8},
        2048: {_T: 1908, _MEGA: 3530, _DGM: 6384, _DGC: 2959},
        8192: {_T: 4812, _MEGA: 7565, _DGC: 4038},
    },
    (K3, "bf16"): {
        1: {_T: 250, _MEGA: 257, _DGM: 518, _DGC: 1415},
        8: {_T: 1603, _DGM: 2024, _DGC: 2920},
        32: {_T: 4191, _DGM: 4970, _DGC: 6796},
        128: {_T: 5528, _DGM: 6624, _DGC: 8786},
        512: {_T: 5819, _MEGA: 6258, _DGM: 7881, _DGC: 9270},
        2048: {_T: 7416, _MEGA: 12336, _DGC: 9109},
        8192: {_T: 18017, _MEGA: 36290, _DGC: 18608},
    },
    (K3, "fp8"): {
        1: {_T: 143, _MEGA: 147, _DGM: 549, _DGC: 1364},
        8: {_T: 866, _DGM: 1302, _DGC: 1937},
        32: {_T: 2247, _DGM: 2842, _DGC: 3996},
        128: {_T: 2979, _DGM: 3946, _DGC: 5062},
        512: {_T: 3496, _MEGA: 4474, _DGM: 6022, _DGC: 5600},
        2048: {_T: 5447, _MEGA: 8904, _DGC: 5665},
        8192: {_T: 14251, _MEGA: 25440, _DGC: 11572},
    },
}


def bucket_times(shape: MoeShape, dtype: str, m: int) -> tuple[int, dict[str, float]] | None:
    """The measured bucket that a batch of ``m`` tokens reads, or None (shape not measured)."""
    table = MEASURED_US.get((shape, dtype))
    if not table:
        return None
    below = [b for b in table if b <= m]
    bucket = max(below) if below else min(table)
    return bucket, table[bucket]


def fastest_path(
    shape: MoeShape, dtype: str, m: int, candidates: Iterable[str]
) -> tuple[str, str] | None:
    """The fastest measured path among ``candidates`` at ``m`` tokens and why, or None when
    none of them was measured at that bucket (the caller keeps its own default)."""
    found = bucket_times(shape, dtype, m)
    if found is None:
        return None
    bucket, times = found
    timed = {p: times[p] for p in candidates if p in times}
    if not timed:
        return None
    best = min(timed, key=lambda p: timed[p])
    others = ", ".join(f"{p} {us:.0f}" for p, us in sorted(timed.items()) if p != best)
    return best, f"M bucket {bucket}: {best} {timed[best]:.0f} us (measured; {others or 'alone'})"


def mega_moe_measured_slower(
    shape: MoeShape, dtype: str, m: int, mega_path: str = _MEGA
) -> str | None:
    """Why the MegaMoE kernel ``mega_path`` should not take ``m`` tokens: a reason when it
    measured slower than the fastest non-mega path at that bucket, else None (also when it was
    not measured there: the user's choice stands)."""
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
