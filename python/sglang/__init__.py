"""sglang: a compact serving engine for DeepSeek V4 and Kimi K3 MoE models.

Importing the package must work on a machine with no GPU and without optional packages
(DeepGEMM, TileLang), so nothing heavy is imported here.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
