"""Checks of a model's static (pooled-slot) decode that every model with a slot pool must pass
the same way."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def check_decode_pooled_refusals(model: Any, capacity: int) -> None:
    """``decode_pooled`` refuses a cache outside the slot pool, and a pooled cache already
    holding ``capacity`` tokens (the pool's length), each with an error that says which."""
    with pytest.raises(ValueError, match="pooled"):
        model.decode_pooled(torch.tensor([1]), [model.new_request_cache()])
    cache = model.new_pooled_cache()
    cache.num_tokens = capacity
    with pytest.raises(RuntimeError, match="capacity"):
        model.decode_pooled(torch.tensor([1]), [cache])
    model.free_pooled_cache(cache)
