"""``--kv-cache-dtype``: how the caches that grow with every token store their rows (the choice;
``row_codec.py`` is how a row is then stored).

- ``bf16``: the model dtype (the name follows SGLang's flag; with ``--dtype float32`` the rows
  are fp32).
- ``fp8_e4m3``: FP8 rows (``kernels/ops/quant/fp8_rows.py``: e4m3 values in groups with UE8M0
  scales, positional dims kept bf16): DeepSeek V4's compressed entries (ratios 4 and 128, 584
  bytes at head dim 512) and indexer keys (136 bytes at 128), Kimi K3's MLA latents (648 bytes).
  DeepSeek V4's sliding-window ring stays in the model dtype either way: it is a fixed 128 rows a
  layer and request, so FP8 there would not change how many tokens fit, and it holds the most
  recent (most attended) keys.
- ``auto``: what the model's published inference recipe does. DeepSeek V4: FP8 compressed entries
  and indexer keys when the model runs in bf16 (DeepSeek's inference code and FlashMLA keep the
  compressed KV in this 584-byte FP8 layout; its indexer keys are FP8 as in V3.2), the model dtype
  otherwise (fp32 is the reference path). Kimi K3: the model dtype (no published recipe caches
  its latents in FP8).

FP8 rows need bf16 or fp32 compute (the bf16 tail and the exact dequantisation into bf16): with
``--dtype float16`` an explicit ``fp8_e4m3`` is refused at startup, ``auto`` keeps float16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the flag's checks stay importable without torch (server_args)
    import torch

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
# Model dtypes whose caches may hold FP8 rows (``--dtype`` names).
FP8_MODEL_DTYPES = ("bfloat16", "float32")


def kv_cache_dtype_error(choice: str, model_dtype: str) -> str | None:
    """Why ``--kv-cache-dtype choice`` cannot run with ``--dtype model_dtype`` (None: it can)."""
    if choice not in KV_CACHE_DTYPES:
        return f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {choice!r}"
    if choice == "fp8_e4m3" and model_dtype not in FP8_MODEL_DTYPES:
        return (
            f"--kv-cache-dtype fp8_e4m3 needs --dtype bfloat16 or float32 (FP8 rows keep a bf16 "
            f"tail and dequantise exactly into bf16), got --dtype {model_dtype}; use "
            "--kv-cache-dtype bf16 or --dtype bfloat16"
        )
    return None


@dataclass(frozen=True)
class KVCacheChoice:
    """What ``--kv-cache-dtype`` resolved to for one model: FP8 rows or the model dtype, and why
    (for the startup log)."""

    fp8: bool
    why: str

    @property
    def name(self) -> str:
        return "fp8_e4m3" if self.fp8 else "bf16"


def resolve_kv_cache_dtype(
    choice: str, model_dtype: torch.dtype, *, fp8_recipe: str | None
) -> KVCacheChoice:
    """``choice`` for a model computing in ``model_dtype``; ``fp8_recipe`` names the published
    recipe that caches this model in FP8 (None: ``auto`` is the model dtype)."""
    dtype_name = str(model_dtype).removeprefix("torch.")
    why = kv_cache_dtype_error(choice, dtype_name)
    if why is not None:
        raise ValueError(why)
    if choice == "fp8_e4m3":
        return KVCacheChoice(True, "--kv-cache-dtype fp8_e4m3")
    if choice == "bf16":
        return KVCacheChoice(False, f"--kv-cache-dtype bf16 (the model dtype, {dtype_name})")
    if fp8_recipe is None:
        return KVCacheChoice(False, f"auto: the model dtype ({dtype_name}), no FP8 recipe")
    if dtype_name != "bfloat16":
        return KVCacheChoice(False, f"auto: the model dtype ({dtype_name}); FP8 with bf16 only")
    return KVCacheChoice(True, f"auto: {fp8_recipe}")


class KVLayout(Protocol):
    """What a model's cache layout tells the executor (DeepSeek V4's and Kimi K3's)."""

    @property
    def choice(self) -> KVCacheChoice: ...

    def describe(self) -> str:
        """One line: the choice and how every kind of cached row is stored (bytes a row)."""
        ...
