"""A checkpoint's tensors by the model's canonical names, and the error every loader raises."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.model_loader.weight_source import WeightSource


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape or type, or is not expected."""


@dataclass
class CheckpointIndex:
    """Canonical (model) name -> checkpoint name, built once per load; remembers what was used so
    the loader can name tensors nothing asked for."""

    source: WeightSource
    by_canon: dict[str, str]
    used: set[str]

    def has(self, canon: str) -> bool:
        return canon in self.by_canon

    def get(self, canon: str) -> torch.Tensor:
        if canon not in self.by_canon:
            raise WeightLoadError(f"checkpoint is missing tensor {canon!r}")
        self.used.add(canon)
        return self.source.get(self.by_canon[canon])

    def ckpt_name(self, canon: str) -> str:
        return self.by_canon.get(canon, canon)
