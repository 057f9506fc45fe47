"""A checkpoint's tensors by the model's canonical names, and the error every loader raises.

Each model's loader maps checkpoint names onto its parameter names with its own
``canonical_name``; what follows from there (indexing, copying a parameter, tied embeddings,
reporting missing and unused tensors) is the same for every model and lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from sglang.srt.layers.linear import (
    BlockFp8Weight,
    WeightFormatError,
    WeightShapeError,
    copy_checked,
)
from sglang.srt.model_loader.weight_source import WeightSource


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape or type, or is not expected."""


@dataclass
class ReadBytes:
    """The bytes of the checkpoint tensors read inside one :meth:`CheckpointIndex.counting`
    block, by stored dtype (a checkpoint tensor read twice in a load counts once)."""

    by_dtype: dict[torch.dtype, int] = field(default_factory=dict)

    def add(self, dtype: torch.dtype, nbytes: int) -> None:
        self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())


@dataclass
class CheckpointIndex:
    """Canonical (model) name -> checkpoint name, built once per load; remembers what was used so
    the loader can name tensors nothing asked for, and counts the bytes it reads."""

    source: WeightSource
    by_canon: dict[str, str]
    used: set[str]
    _counted: set[str] = field(default_factory=set)
    _counters: list[ReadBytes] = field(default_factory=list)

    @classmethod
    def build(
        cls, source: WeightSource, canonical: Callable[[str], str | None]
    ) -> tuple[CheckpointIndex, list[str]]:
        """The index of ``source``, and the checkpoint names ``canonical`` maps to ``None``
        (skipped; the caller says why). Two names for one parameter are an error."""
        by_canon: dict[str, str] = {}
        skipped: list[str] = []
        for name in source.names():
            canon = canonical(name)
            if canon is None:
                skipped.append(name)
                continue
            if canon in by_canon:
                raise WeightLoadError(
                    f"checkpoint tensors {by_canon[canon]!r} and {name!r} both map to {canon!r}"
                )
            by_canon[canon] = name
        return cls(source, by_canon, set()), skipped

    def has(self, canon: str) -> bool:
        return canon in self.by_canon

    def get(self, canon: str) -> torch.Tensor:
        if canon not in self.by_canon:
            raise WeightLoadError(f"checkpoint is missing tensor {canon!r}")
        self.used.add(canon)
        name = self.by_canon[canon]
        tensor = self.source.get(name)
        if self._counters and name not in self._counted:
            self._counted.add(name)
            for counter in self._counters:
                counter.add(tensor.dtype, tensor.numel() * tensor.element_size())
        return tensor

    def dtype_of(self, canon: str) -> torch.dtype:
        """The stored dtype of ``canon``, without reading it (nor counting it as used)."""
        if canon not in self.by_canon:
            raise WeightLoadError(f"checkpoint is missing tensor {canon!r}")
        return self.source.dtype_of(self.by_canon[canon])

    @contextmanager
    def counting(self) -> Iterator[ReadBytes]:
        """Count the bytes of the checkpoint tensors read in the block (the loader's record of
        what a rank's share of the checkpoint holds)."""
        counter = ReadBytes()
        self._counters.append(counter)
        try:
            yield counter
        finally:
            self._counters.remove(counter)

    def mark_used(self, *canons: str) -> None:
        """Count those of ``canons`` the checkpoint has as used without reading them (another
        rank's experts)."""
        self.used.update(c for c in canons if c in self.by_canon)

    def ckpt_name(self, canon: str) -> str:
        return self.by_canon.get(canon, canon)

    def tie(self, head: str, embed: str) -> None:
        """A tied checkpoint stores the table once; the LM head reads the same tensor."""
        if not self.has(head) and self.has(embed):
            self.by_canon[head] = self.by_canon[embed]

    @contextmanager
    def naming(self, canon: str) -> Iterator[None]:
        """A layer's shape or format complaint about ``canon`` becomes a load error naming both
        spellings."""
        try:
            yield
        except (WeightShapeError, WeightFormatError) as exc:
            raise WeightLoadError(
                f"tensor {self.ckpt_name(canon)!r} (model {canon!r}): {exc}"
            ) from None

    def load_param(
        self, canon: str, param: nn.Parameter, tensor: torch.Tensor | BlockFp8Weight
    ) -> None:
        """``tensor`` (full, unsharded) into ``param`` through its ``weight_loader`` (this rank's
        shard), or a shape-checked copy for parameters without one (replicated norms)."""
        loader = getattr(param, "weight_loader", copy_checked)
        with self.naming(canon):
            loader(param, tensor)

    def require(self, names: Iterable[str], hint: str) -> None:
        """Fail naming the first few of ``names`` the checkpoint lacks; ``hint`` says how the
        names are spelled."""
        missing = [n for n in names if not self.has(n)]
        if missing:
            raise WeightLoadError(
                f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]} ({hint})"
            )

    def check_all_used(self, *, strict: bool, logger: logging.Logger) -> None:
        """Tensors nothing asked for: an error when ``strict``, else a warning."""
        left = sorted(set(self.by_canon) - self.used)
        if left:
            examples = [self.ckpt_name(n) for n in left[:5]]
            msg = f"checkpoint has {len(left)} tensor(s) the model does not use, e.g. {examples}"
            if strict:
                raise WeightLoadError(msg)
            logger.warning(msg)
