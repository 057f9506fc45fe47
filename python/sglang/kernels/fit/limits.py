"""A device's per-block and per-SM limits, the numbers a kernel configuration must fit.

Read once per device from ``torch.cuda.get_device_properties``; tests pass :data:`H200` to the
decision functions instead, so a CPU machine checks what the H200 would accept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceLimits:
    """What one thread block may use, and the SM count: ``shared_optin_bytes`` is the shared
    memory a block may opt into (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), ``regs_per_block``
    the registers a block may hold (threads x registers a thread), ``shared_per_sm_bytes`` what
    the blocks resident on one SM share, ``capability`` the SM version (``(9, 0)``: Hopper)."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    shared_optin_bytes: int
    regs_per_sm: int
    shared_per_sm_bytes: int = 233472
    regs_per_block: int = 65536
    max_threads_per_block: int = 1024
    max_regs_per_thread: int = 255

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def hopper_or_newer(self) -> bool:
        return self.capability >= (9, 0)


# One H200 (sm_90, 132 SMs), as torch reports it there; the CPU tests' device.
H200 = DeviceLimits(
    name="NVIDIA H200",
    capability=(9, 0),
    sm_count=132,
    shared_optin_bytes=232448,
    regs_per_sm=65536,
)

# One B200 (sm_100, 148 SMs): the Blackwell suite's device.
B200 = DeviceLimits(
    name="NVIDIA B200",
    capability=(10, 0),
    sm_count=148,
    shared_optin_bytes=232448,
    regs_per_sm=65536,
)


@functools.cache
def _cuda_limits(index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(index)
    shared = int(
        getattr(props, "shared_memory_per_block_optin", 0)
        or getattr(props, "shared_memory_per_block", 49152)
    )
    regs = int(getattr(props, "regs_per_multiprocessor", 65536))
    per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or shared + 1024)
    return DeviceLimits(
        name=str(props.name),
        capability=(int(props.major), int(props.minor)),
        sm_count=int(props.multi_processor_count),
        shared_optin_bytes=shared,
        regs_per_sm=regs,
        shared_per_sm_bytes=per_sm,
        regs_per_block=min(regs, 65536),
        max_threads_per_block=int(getattr(props, "max_threads_per_block", 1024)),
    )


def device_limits(device: torch.device | str | None) -> DeviceLimits | None:
    """The limits of a CUDA device (cached); None elsewhere (CPU, the Triton interpreter), where
    no kernel configuration is refused for its size."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_limits(dev.index if dev.index is not None else torch.cuda.current_device())
