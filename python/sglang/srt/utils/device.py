"""Facts about the physical GPU, read from the driver and cached per device index."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSMInfo:
    """What the SM-budget logic needs to know about one GPU."""

    index: int
    num_sms: int
    capability: tuple[int, int]

    @property
    def arch(self) -> int:
        """Compute capability as one number: (9, 0) -> 90, (10, 0) -> 100."""
        return self.capability[0] * 10 + self.capability[1]


def current_device_index() -> int:
    return torch.cuda.current_device()


@functools.cache
def _read_device_sm_info(index: int) -> DeviceSMInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceSMInfo(index, int(props.multi_processor_count), (props.major, props.minor))


def device_sm_info(device: int | torch.device | None = None) -> DeviceSMInfo:
    """Physical SM count and capability of ``device`` (default: the current CUDA device).

    Read from the device properties, never from a library's process-wide setting, which other
    features may have narrowed."""
    if device is None:
        index = current_device_index()
    elif isinstance(device, torch.device):
        index = device.index if device.index is not None else current_device_index()
    else:
        index = int(device)
    return _read_device_sm_info(index)
