"""Timeouts in tests are hang guards, never pass/fail criteria that depend on machine load.

A step that takes ``t`` seconds on an unloaded machine gets ``hang_guard(t)`` =
``HANG_GUARD_FACTOR * t``: enough for a loaded CI machine (several test processes sharing two
cores), short enough that a real hang still ends the test. Every timeout in the tests (subprocess
timeouts, waits, polling deadlines, elapsed-time bounds) is at least that; the sites and their
unloaded times are listed in ``docs/testing.md`` ("Timeouts are hang guards").
"""

from __future__ import annotations

HANG_GUARD_FACTOR = 5


def hang_guard(unloaded_s: float) -> float:
    """The timeout for a step measured at ``unloaded_s`` seconds on an unloaded machine."""
    if not unloaded_s > 0:
        raise ValueError(f"an unloaded time must be > 0 seconds, got {unloaded_s!r}")
    return HANG_GUARD_FACTOR * unloaded_s
