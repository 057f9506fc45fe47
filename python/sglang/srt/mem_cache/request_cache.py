"""What every model's per-request cache has: its per-layer state and how many tokens it holds.

The count lets a forward check that the positions it is given continue the cache; the layer
states are the model's own (V4's window rings and compressors, K3's KDA states and MLA latents).
"""

from __future__ import annotations

from typing import Generic, TypeVar

LayerT = TypeVar("LayerT")


class RequestCache(Generic[LayerT]):
    def __init__(self, layers: list[LayerT]) -> None:
        self.layers = layers
        self.num_tokens = 0

    def __len__(self) -> int:
        return self.num_tokens
