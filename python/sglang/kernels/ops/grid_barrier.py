"""A persistent Triton kernel with a whole-grid software barrier whose wait is bounded.

It reproduces, with a kernel of our own, the failure the reserved-SM control prevents: a grid
sized to fill every CTA slot of the GPU waits at a software barrier for CTAs that can never become
resident while a kernel on another stream holds a slot. Here the wait gives up after a deadline
and the launch reports it, instead of hanging the GPU.

Each CTA writes its id, arrives at the barrier, then reads its neighbour's id: a correct barrier
makes ``out[pid] == (pid + 1) % grid``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.gpu_clock import globaltimer_ns

NUM_WARPS = 32  # 1024 threads a CTA: at most two CTAs per Hopper SM, so one held slot matters


class GridSyncTimeout(RuntimeError):
    """A whole-grid barrier gave up waiting: not every CTA of the grid became resident."""


@triton.jit
def _poll_count(count_ptr, want, timeout_ns):
    # Acquire-read the counter until it reaches ``want`` or ``timeout_ns`` has passed; returns the
    # last value read (below ``want`` means the wait gave up).
    start = globaltimer_ns()
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    elapsed = globaltimer_ns() - start
    while (seen < want) & (elapsed < timeout_ns):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        elapsed = globaltimer_ns() - start
    return seen


@triton.jit(do_not_specialize=["timeout_ns"])
def _grid_barrier_kernel(ids_ptr, out_ptr, counter_ptr, status_ptr, timeout_ns):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tl.store(ids_ptr + pid, pid)
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = _poll_count(counter_ptr, grid, timeout_ns)
    if arrived < grid:
        tl.atomic_max(status_ptr, 1)  # report, then leave: the launch must end
        tl.store(out_ptr + pid, -1)
    else:
        neighbour = (pid + 1) % grid
        tl.store(out_ptr + pid, tl.load(ids_ptr + neighbour, volatile=True))


@triton.jit(do_not_specialize=["hold_ns"])
def _hold_slot_kernel(started_ptr, hold_ns):
    """Each CTA occupies one slot for ``hold_ns`` nanoseconds; counts itself when resident."""
    tl.atomic_add(started_ptr, 1, sem="release", scope="gpu")
    start = globaltimer_ns()
    elapsed = globaltimer_ns() - start
    while elapsed < hold_ns:
        elapsed = globaltimer_ns() - start


@triton.jit(do_not_specialize=["want", "timeout_ns"])
def _wait_count_kernel(count_ptr, want, timeout_ns):
    """Stream-order the next launch after ``count >= want`` (bounded, never hangs)."""
    _poll_count(count_ptr, want, timeout_ns)


def _compile_helpers(device: torch.device) -> None:
    """Compile the slot holder and the waiter now: compiling them inside a trial would let the
    held slot expire before the barrier launches."""
    counter = torch.ones(1, dtype=torch.int32, device=device)
    _hold_slot_kernel[(1,)](counter, 0, num_warps=NUM_WARPS)
    _wait_count_kernel[(1,)](counter, 0, 0, num_warps=1)
    torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    num_sms: int
    registers: int
    shared_bytes: int

    @property
    def full_grid(self) -> int:
        return self.ctas_per_sm * self.num_sms


def barrier_occupancy(device: torch.device | None = None) -> Occupancy:
    """How many barrier CTAs can be resident at once, from the compiled kernel's resources."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    scratch = torch.zeros(2, dtype=torch.int32, device=device)
    compiled = _grid_barrier_kernel.warmup(
        scratch, scratch, scratch, scratch, 1, grid=(1,), num_warps=NUM_WARPS
    )
    compiled._init_handles()
    _compile_helpers(device)
    regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
    per_sm = resident_ctas_per_sm(regs, shared, NUM_WARPS, props)
    return Occupancy(per_sm, int(props.multi_processor_count), regs, shared)


def resident_ctas_per_sm(regs: int, shared: int, num_warps: int, props: Any) -> int:
    """How many CTAs of a compiled kernel (registers a thread, shared bytes a CTA) fit on one SM
    at once: the least of the thread, register and shared-memory limits."""
    threads = 32 * num_warps
    by_threads = props.max_threads_per_multi_processor // threads
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256  # allocated in units of 256 a warp
    by_regs = (props.regs_per_multiprocessor // regs_per_warp) // num_warps
    by_smem = props.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32
    return max(1, min(by_threads, by_regs, by_smem, 32))


@dataclass
class BarrierLaunch:
    grid: int
    out: torch.Tensor
    status: torch.Tensor

    def timed_out(self) -> bool:
        return bool(self.status.item())

    def check(self, sm_budget: int | None) -> None:
        """Raise :class:`GridSyncTimeout` if the barrier gave up; else verify the exchange."""
        if self.timed_out():
            raise GridSyncTimeout(
                f"grid barrier timed out: {self.grid} CTAs launched but not all became resident "
                f"(SM budget {sm_budget}); another stream holds SMs. Raise "
                "SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS to leave more SMs free."
            )
        want = (torch.arange(self.grid, device=self.out.device) + 1) % self.grid
        if not torch.equal(self.out, want.to(self.out.dtype)):
            raise AssertionError("grid barrier completed but CTAs read unwritten neighbour ids")


def grid_barrier_unfit_reason(limits: DeviceLimits | None) -> str | None:
    """None when the barrier and slot-holder kernels fit the device (one CTA of
    :data:`NUM_WARPS` warps, no shared memory) and the family is on, else why not."""
    return unfit_reason("grid_barrier", Footprint(0, NUM_WARPS), limits, what="grid barrier CTA")


def launch_grid_barrier(grid: int, timeout_ms: float, device: torch.device) -> BarrierLaunch:
    """Launch the barrier kernel with ``grid`` CTAs on the current stream (asynchronous)."""
    ids = torch.full((grid,), -7, dtype=torch.int32, device=device)
    out = torch.full((grid,), -9, dtype=torch.int32, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    _grid_barrier_kernel[(grid,)](
        ids, out, counter, status, int(timeout_ms * 1e6), num_warps=NUM_WARPS
    )
    return BarrierLaunch(grid, out, status)


def hold_slots(
    stream: torch.cuda.Stream, hold_ms: float, device: torch.device, num_slots: int = 1
) -> torch.Tensor:
    """Start ``num_slots`` CTAs on ``stream`` that each hold a slot for ``hold_ms``; make the
    current stream wait until they are resident. Returns their started counter."""
    started = torch.zeros(1, dtype=torch.int32, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        _hold_slot_kernel[(num_slots,)](started, int(hold_ms * 1e6), num_warps=NUM_WARPS)
    wait_for_count(started, num_slots, hold_ms)
    return started


def wait_for_count(counter: torch.Tensor, want: int, timeout_ms: float) -> None:
    """Make the current stream wait until ``counter >= want`` (bounded by ``timeout_ms``)."""
    _wait_count_kernel[(1,)](counter, want, int(timeout_ms * 1e6), num_warps=1)


@dataclass(frozen=True)
class TrialResult:
    grid: int
    timed_out: bool
    elapsed_ms: float


def run_trial(
    grid: int,
    *,
    timeout_ms: float,
    hold_ms: float | None,
    device: torch.device,
    side_stream: torch.cuda.Stream | None = None,
    held_slots: int = 1,
) -> TrialResult:
    """One barrier launch of ``grid`` CTAs, optionally while a side-stream kernel holds
    ``held_slots`` CTA slots for ``hold_ms`` (longer than ``timeout_ms``). Synchronises; checks
    the exchange when the barrier completed."""
    torch.cuda.synchronize(device)
    if hold_ms is not None:
        hold_slots(side_stream or torch.cuda.Stream(device), hold_ms, device, held_slots)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    launch = launch_grid_barrier(grid, timeout_ms, device)
    end.record()
    torch.cuda.synchronize(device)
    timed_out = launch.timed_out()
    if not timed_out:
        launch.check(None)
    return TrialResult(grid, timed_out, begin.elapsed_time(end))
