"""sglang: a compact serving engine for DeepSeek V4 and Kimi K3 MoE models.

Importing the package must work on a machine with no GPU and without optional packages
(DeepGEMM, TileLang), so nothing heavy is imported here: ``sglang.Engine`` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.version import __version__

__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
