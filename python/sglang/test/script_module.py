"""A script of the repository's ``scripts/`` folder loaded as a module, so its tests can call its
functions (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """``path`` loaded as the module named after its file. It is put in ``sys.modules`` first, as
    an import would, so the script's dataclasses and pickles can find their module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
