"""A name -> factory registry for pluggable backends (MoE runners, attention backends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return decorate

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._factories))

    def create(self, name: str, *args: object, **kwargs: object) -> T:
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            )
        return factory(*args, **kwargs)
