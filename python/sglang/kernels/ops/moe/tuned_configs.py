"""Per-device fused-MoE config tables, written by ``scripts/tune_fused_moe.py``, and the lookup.

A table is one JSON file in ``configs/`` per (expert shape, weight dtype, device), named
``E{E}_H{H}_I{I}_top{k}_{dtype}_{device}.json`` (the device name with spaces as ``_``, as
``torch.cuda.get_device_name`` gives it). It lists M buckets (token counts); each names the
kernel that measured fastest there, ``two_launch`` (``fused_moe.py``) or ``tma``
(``grouped_gemm_tma.py``), with the tiles that won; a ``two_launch`` bucket without a ``config``
uses ``get_config``'s rule. A call of M tokens takes the bucket with
the largest ``m <= M`` (the smallest bucket below that). Without a table: the TMA kernels with
:data:`DEFAULT_TMA_CONFIGS` once an expert averages :data:`TMA_MIN_ROWS_PER_EXPERT` rows (prefill,
compute-bound), the two-launch path below (decode, weight-streaming).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from sglang.kernels.fit.footprint import element_bytes
from sglang.kernels.fit.limits import DeviceLimits, device_limits
from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, TmaMoeConfig, tma_unfit_reason
from sglang.kernels.ops.moe.two_launch_config import (
    FusedMoeConfig,
    GemmTile,
    fit_two_launch_config,
    get_config,
    two_launch_unfit_reason,
)
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
TMA_MIN_ROWS_PER_EXPERT = 32
# The H200 sweep's winners at 8192 tokens (DeepSeek V4 shape), for shapes without a table.
DEFAULT_TMA_CONFIGS = {
    "bf16": TmaMoeConfig(128, TmaGemmTile(128, 64, 16, 8, 4), TmaGemmTile(256, 64, 16, 8, 3)),
    "fp8": TmaMoeConfig(64, TmaGemmTile(128, 128, 32, 8, 4), TmaGemmTile(256, 128, 32, 8, 3)),
}

MoeKernelConfig = FusedMoeConfig | TmaMoeConfig


def dtype_key(dtype: torch.dtype) -> str:
    if dtype == FP8_DTYPE:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def table_name(e: int, h: int, i: int, top_k: int, dtype: str, device_name: str) -> str:
    return f"E{e}_H{h}_I{i}_top{top_k}_{dtype}_{device_name.replace(' ', '_')}.json"


def tma_config_to_dict(cfg: TmaMoeConfig) -> dict[str, Any]:
    return asdict(cfg)


def tma_config_from_dict(d: dict[str, Any]) -> TmaMoeConfig:
    return TmaMoeConfig(
        int(d["block_m"]),
        TmaGemmTile(**d["gemm1"]),
        TmaGemmTile(**d["gemm2"]),
        sorted_a=bool(d.get("sorted_a", False)),
        half_tiles=bool(d.get("half_tiles", False)),
    )


def two_launch_config_to_dict(cfg: FusedMoeConfig) -> dict[str, Any]:
    return asdict(cfg)


def two_launch_config_from_dict(d: dict[str, Any]) -> FusedMoeConfig:
    return FusedMoeConfig(int(d["block_m"]), GemmTile(**d["gemm1"]), GemmTile(**d["gemm2"]))


# (M, kernel, its tiles): None for a two-launch bucket that keeps get_config's rule.
Bucket = tuple[int, str, MoeKernelConfig | None]


def table_buckets(path: Path) -> list[dict[str, Any]] | None:
    """The buckets a table file lists (this module's and ``mxfp4_config.py``'s), in order of M;
    None when there is no such file."""
    if not path.is_file():
        return None
    return sorted(json.loads(path.read_text())["buckets"], key=lambda b: int(b["m"]))


@functools.cache
def load_table(name: str) -> tuple[Bucket, ...] | None:
    """The buckets of table ``name`` sorted by M, or None when there is no such file."""
    raw = table_buckets(CONFIG_DIR / name)
    if raw is None:
        return None
    buckets: list[Bucket] = []
    for b in raw:
        cfg: MoeKernelConfig | None = None
        if b["kernel"] == "tma":
            cfg = tma_config_from_dict(b["config"])
        elif b.get("config"):
            cfg = two_launch_config_from_dict(b["config"])
        buckets.append((int(b["m"]), str(b["kernel"]), cfg))
    return tuple(buckets)


BucketT = TypeVar("BucketT", bound=tuple[Any, ...])


def pick_bucket(buckets: Sequence[BucketT], m: int) -> BucketT:
    """The bucket a call of ``m`` tokens takes from ``buckets`` (sorted by their first item, the
    bucket's M): the largest M ``<= m``, else the smallest."""
    below = [b for b in buckets if b[0] <= m]
    return below[-1] if below else buckets[0]


def _device_name(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


@functools.cache
def _log_choice(name: str, m_bucket: int, what: str) -> None:
    logger.info("fused MoE %s, M bucket %d: %s", name, m_bucket, what)


def select_moe_config(
    m: int,
    e: int,
    h: int,
    i: int,
    dtype: torch.dtype,
    *,
    top_k: int,
    device: torch.device,
    scale_block: int = 128,
    limits: DeviceLimits | None = None,
) -> MoeKernelConfig | None:
    """The kernel and tiles for ``m`` tokens: the tuned table's bucket, else the default rule,
    kept only where it fits the device (``limits``, default: ``device``'s). A TMA config that
    cannot run here (shape, GPU older than Hopper, shared memory, the TMA family off) falls back
    to two-launch; a two-launch config over the limits to the first smaller one that fits
    (``fit_two_launch_config``: fp32 operands take fewer pipeline stages); None when none fits
    (the caller runs the torch experts). Each adjustment is logged once."""
    if limits is None:
        limits = device_limits(device)
    key = dtype_key(dtype)
    fp8 = key == "fp8"
    dev_name = _device_name(device)
    name = table_name(e, h, i, top_k, key, dev_name) if dev_name else ""
    buckets = load_table(name) if name else None
    cfg: MoeKernelConfig | None
    if buckets:
        m_bucket, kernel, cfg = pick_bucket(buckets, m)
        source = f"table {name}"
        if isinstance(cfg, FusedMoeConfig) and m >= m_bucket:
            # Tiles tuned at m_bucket rows; below the smallest bucket the rule decides.
            _log_choice(name, m_bucket, f"two_launch {cfg} ({source})")
            return fit_two_launch(cfg, dtype, limits)
    else:
        m_bucket = 0  # one log line per choice
        rows = m * top_k / max(e, 1)
        cfg = DEFAULT_TMA_CONFIGS.get(key) if rows >= TMA_MIN_ROWS_PER_EXPERT else None
        kernel, source = ("tma" if cfg else "two_launch"), "default rule (no table)"
    if isinstance(cfg, TmaMoeConfig):
        why = tma_unfit_reason(cfg, h, i, fp8, scale_block, limits)
        if why is None:
            _log_choice(name or "untuned", m_bucket, f"{kernel} {cfg} ({source})")
            return cfg
        _log_choice(name or "untuned", m_bucket, f"not {kernel} {cfg}: {why}")
    rule = get_config(m, e, h, i, dtype, top_k=top_k)
    _log_choice(name or "untuned", m_bucket, f"two_launch ({source})")
    return fit_two_launch(rule, dtype, limits)


def fit_two_launch(
    cfg: FusedMoeConfig, dtype: torch.dtype, limits: DeviceLimits | None
) -> FusedMoeConfig | None:
    """``cfg`` fitted to ``limits`` for ``dtype`` weights (a smaller config, or None), logged
    once when it changes."""
    elem = element_bytes(dtype)
    fitted = fit_two_launch_config(cfg, elem, limits)
    if fitted != cfg:
        why = two_launch_unfit_reason(cfg, elem, limits)
        what = f"{fitted}" if fitted is not None else "none fits: the torch experts run"
        _log_choice("fit", 0, f"{cfg} does not fit ({why}); {what}")
    return fitted
