"""A stand-in for the DeepGEMM module that records how the engine drives it.

DeepGEMM's kernels cannot run on every machine (its wheels are built for one torch), so the call
sites are tested against this fake: it keeps a process-wide SM count like the real module and
logs every call in order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeSymmBuffer:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    num_sms_at_creation: int


@dataclass
class FakeDeepGemm:
    num_sms: int = 132
    buffer_uses_num_sms: bool = True
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def MEGA_MOE_BUFFER_USES_NUM_SMS(self) -> bool:  # noqa: N802 - mirrors a module constant
        return self.buffer_uses_num_sms

    def _record(self, name: str, value: Any = None) -> None:
        with self._lock:
            self.calls.append((name, value))

    def get_num_sms(self) -> int:
        return self.num_sms

    def set_num_sms(self, value: int) -> None:
        self._record("set_num_sms", value)
        self.num_sms = value

    def set_calls(self) -> list[int]:
        return [value for name, value in self.calls if name == "set_num_sms"]

    def get_symm_buffer_for_mega_moe(self, *args: Any, **kwargs: Any) -> FakeSymmBuffer:
        self._record("get_symm_buffer_for_mega_moe", self.num_sms)
        return FakeSymmBuffer(args, kwargs, self.num_sms)
