"""The totals every greedy parity sweep (``scripts/*_parity_sweep.py``) prints after its rows:
the prompt lengths covered, the largest logit error and the near-ties, the divergence count and
time, and one ``DIVERGED`` line per diverged case. Each sweep joins these fields with its own."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class ParityCase(Protocol):
    @property
    def label(self) -> str: ...

    @property
    def prompt_lens(self) -> tuple[int, ...]: ...


class ParityResult(Protocol):
    @property
    def case(self) -> ParityCase: ...

    @property
    def max_err(self) -> float: ...  # max |ours - reference| over every compared logit

    @property
    def max_ref(self) -> float: ...  # max |reference logit|

    @property
    def near_ties(self) -> int: ...

    @property
    def first_divergence(self) -> tuple[int, int] | None: ...

    @property
    def ok(self) -> bool: ...


def prompt_lengths_summary(results: Sequence[ParityResult]) -> str:
    lengths = {n for r in results for n in r.case.prompt_lens}
    return f"distinct prompt lengths {len(lengths)} (min {min(lengths)}, max {max(lengths)})"


def logit_error_summary(results: Sequence[ParityResult], margin_tol: float) -> str:
    """The largest logit error (absolute, and relative to the largest reference logit) and the
    near-ties: steps whose token differed from the reference's by less than ``margin_tol``."""
    max_err = max(r.max_err for r in results)
    rel = max(r.max_err / r.max_ref for r in results)
    return (
        f"max logit err {max_err:.2e} (rel {rel:.2e}) | near-ties (margin <= {margin_tol:g}) "
        f"{sum(r.near_ties for r in results)}"
    )


def outcome_summary(results: Sequence[ParityResult], started: float) -> str:
    """The divergence count and the seconds since ``started`` (a ``time.perf_counter()``)."""
    diverged = sum(not r.ok for r in results)
    return f"divergences {diverged} | {time.perf_counter() - started:.0f}s"


def report_divergences(results: Sequence[ParityResult]) -> int:
    """Prints one ``DIVERGED`` line per diverged case; returns the sweep's exit status (1 when
    any case diverged)."""
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"DIVERGED {r.case.label} lengths {r.case.prompt_lens} at {r.first_divergence}")
    return 1 if bad else 0
