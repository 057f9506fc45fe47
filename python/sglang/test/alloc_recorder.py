"""A recording stand-in for ``use_symmetric_memory``: it notes every tensor storage created while
the scope is active, so a test can prove which allocations a call site put in the pool."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Recorder(TorchDispatchMode):
    def __init__(self, sink: list[int]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sink.append(t.untyped_storage().data_ptr())
        return out


class SymmetricScopeRecorder:
    """Call like ``use_symmetric_memory(group, disabled=...)``; ``allocated`` lists the storages
    created inside enabled scopes, ``entered`` counts (group, disabled) uses."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.entered: list[tuple[Any, bool]] = []

    @contextmanager
    def __call__(self, group: Any, disabled: bool = False) -> Iterator[None]:
        self.entered.append((group, disabled))
        if disabled:
            yield
            return
        with _Recorder(self.allocated):
            yield
