"""The package version, in a module of its own so that any layer can read it without importing
the package's lazy ``Engine`` face (``sglang/__init__.py``)."""

from __future__ import annotations

__version__ = "0.1.0"
