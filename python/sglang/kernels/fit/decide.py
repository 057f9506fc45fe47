"""The two steps every decision function takes, and the one log line a fallback writes.

``unfit_reason(family, footprint, limits)``: None when the family is on and a block of
``footprint`` fits ``limits``, else why not. ``note_fallback``: one log line per distinct
(family, reason), for fallbacks taken inside ``kernels/`` (the layers in ``srt/`` log their own
choices).
"""

from __future__ import annotations

import logging
import threading

import torch

from sglang.kernels.fit.footprint import Footprint, fit_reason
from sglang.kernels.fit.limits import DeviceLimits, device_limits
from sglang.kernels.fit.switch import family_off_reason

logger = logging.getLogger("sglang.kernels.fit")
_noted: set[tuple[str, str]] = set()
_noted_lock = threading.Lock()


def limits_for(t: torch.Tensor | torch.device | None) -> DeviceLimits | None:
    """The limits of the device ``t`` lives on (None off CUDA)."""
    device = getattr(t, "device", t)
    if not isinstance(device, (torch.device, str)):
        return None
    return device_limits(device)


def unfit_reason(
    family: str,
    footprint: Footprint | None = None,
    limits: DeviceLimits | None = None,
    *,
    what: str | None = None,
) -> str | None:
    """Why the family's kernel must not be chosen (None: it may): turned off after a build
    failure, or ``footprint`` over ``limits``."""
    off = family_off_reason(family)
    if off is not None:
        return f"the {family} kernels are off after a build failure ({off})"
    if footprint is None:
        return None
    return fit_reason(what or family, footprint, limits)


def note_fallback(family: str, reason: str, fallback: str) -> None:
    """Log once that ``family`` was not chosen for ``reason`` and ``fallback`` runs instead."""
    key = (family, reason)
    with _noted_lock:
        if key in _noted:
            return
        _noted.add(key)
    logger.info("%s kernel not chosen (%s): %s runs instead", family, reason, fallback)
