"""What the MoE benchmark and tuning scripts share: the tuned-table files they write (the format
``sglang.kernels.ops.moe.tuned_configs`` and ``mxfp4_config`` load), for an expert shape of the
MoE tests' kit (``sglang.test.moe_model_cases.Shape``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import triton

from sglang.kernels.ops.moe.tuned_configs import table_name
from sglang.test.moe_model_cases import Shape

Bucket = dict[str, object]


def table_path(out_dir: Path, shape: Shape, dtype: str, device: str) -> Path:
    """Where the tuned table of ``shape`` with ``dtype`` weights on ``device`` lives."""
    name = table_name(shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, device)
    return out_dir / name


def kept_buckets(path: Path, merge: bool) -> list[Bucket]:
    """The buckets of the table at ``path`` a ``--merge`` run keeps (none without it)."""
    if merge and path.is_file():
        return json.loads(path.read_text())["buckets"]
    return []


def merged_buckets(tuned: dict[int, Bucket], kept: list[Bucket]) -> list[Bucket]:
    """This run's buckets, and the kept ones of the M values it did not tune, sorted by M."""
    others = [b for b in kept if int(b["m"]) not in tuned]  # type: ignore[call-overload]
    return sorted([*tuned.values(), *others], key=lambda b: int(b["m"]))  # type: ignore[call-overload]


def write_tuned_table(
    path: Path, device: str, shape: Shape, dtype: str, buckets: list[Bucket], **extra: object
) -> None:
    """Write a tuned table: the device, the shape, the weight dtype, ``extra`` keys (e.g. the
    script that chose it), the Triton and torch versions, and the buckets."""
    table = {
        "device": device,
        "shape": {
            "experts": shape.experts,
            "top_k": shape.top_k,
            "hidden": shape.hidden,
            "inter": shape.inter,
            "activation": shape.activation,
        },
        "dtype": dtype,
        **extra,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "buckets": buckets,
    }
    path.write_text(json.dumps(table, indent=1) + "\n")
