"""When an allocation may go to the symmetric pool: the one rule every layer and model follows.

A tensor that feeds a tensor-parallel collective (a MoE or MLP output, the MoE input an in-place
runner hands on, a DP gather buffer) is allocated inside :func:`symmetric_output_scope`: in the
pool when ``--enable-symm-mem`` is on, there is a TP group and every rank makes the same
allocations now; with the default allocator otherwise. The pool's window registration is
collective, so an allocation of a rank-dependent size must stay out of it (a wrong "symmetric"
could start a one-sided registration: a hang). Intermediates are allocated outside the scope,
because the pool never shrinks. Layers and models enter this scope, never
``use_symmetric_memory`` directly.

Whether every rank allocates the same shapes is a fact of the parallel layout above this package
(DP attention pads a batch to one length on every rank, or not): its owner answers it through
:func:`set_allocation_symmetry`. With no answer registered, every rank runs the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from sglang.srt.distributed.parallel_state import get_tp_group_or_none
from sglang.srt.distributed.symm_mem.allocator import use_symmetric_memory

_symmetry: Callable[[], bool] | None = None


def set_allocation_symmetry(answer: Callable[[], bool] | None) -> None:
    """Register who answers "does every rank make the same allocations now?" (None: every rank
    always does)."""
    global _symmetry
    _symmetry = answer


def is_allocation_symmetric() -> bool:
    """Whether every rank makes the same allocations now (the precondition of the pool)."""
    return True if _symmetry is None else _symmetry()


def symmetric_output_scope() -> AbstractContextManager[object]:
    """Allocate a tensor that feeds a tensor-parallel collective inside this (module docstring)."""
    return use_symmetric_memory(get_tp_group_or_none(), disabled=not is_allocation_symmetric())
