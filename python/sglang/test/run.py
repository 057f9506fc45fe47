"""Run one registered test file directly: ``python path/to/test_x.py``."""

from __future__ import annotations

import sys

import pytest


def run_this_file(path: str) -> None:
    sys.exit(pytest.main([path, "-v", "-rs"]))
