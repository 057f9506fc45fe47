"""Decode CUDA graphs: one graph per batch size of the model's static decode
(:meth:`DeepseekV4ForCausalLM.static_decode`, or Kimi K3's when its gate is open), replayed for
decode-only steps after padding the batch to the next captured size.

Capture follows the symmetric-memory rules (docs: docs/symmetric_memory.md):
- every size is warmed up eagerly *on the capture stream* first, so Triton kernels are compiled
  (one that fails to build is turned off there and its fallback captured: ``kernel_fallback``)
  and any symmetric-pool segment the MoE output needs already exists and is registered (NCCL
  window registration cannot run while a graph captures);
- while capturing, the pool knows the graph's private pool (``set_graph_pool_id``), so an
  allocation inside ``use_symmetric_memory`` pauses it and takes a registered pool block;
- the caller preallocates the symmetric pool only after :meth:`CudaGraphRunner.capture`.
Sizes are captured largest first, so the smaller graphs reuse the largest one's memory.

Inputs live in static buffers (ids, positions, slots); padding rows decode token 0 at position 0
in the slot pool's scratch slot. A replay's logits are a view into the graph's output, valid until
the next replay.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import torch

from sglang.srt.distributed.device_communicators.pynccl_allocator import set_graph_pool_id
from sglang.srt.model_executor.kernel_fallback import run_with_kernel_fallback
from sglang.srt.model_executor.model_abilities import (
    ServedModel,
    SupportsStaticDecode,
    require_ability,
    static_decode_reason,
)
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

# Eager runs per size before its capture: the first compiles, the second settles the allocator.
_WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_bs} | set(range(16, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def graph_unavailable_reason(
    model: ServedModel, device: torch.device, *, disabled: bool
) -> str | None:
    """Why decode cannot run in CUDA graphs with this model and these options (``None``: it
    can)."""
    if disabled:
        return "disabled by --disable-cuda-graph"
    if device.type != "cuda":
        return f"runs on {device.type}, not CUDA"
    why = static_decode_reason(model)  # none, or gated off (Kimi K3)
    if why is not None:
        return why
    # The MegaMoE path is capture-safe (our Triton kernel reads its status back only outside
    # capture), and its fallback is the runner's path; ep's is not. Each layer answers for its
    # a2a backend, its runner and how the runner reads its experts.
    for layer in model.moe_layers():
        why = layer.capture_unsafe_reason
        if why is not None:
            return why
    return None


class CudaGraphRunner:
    def __init__(self, model: object, batch_sizes: Sequence[int], device: torch.device) -> None:
        self.model = require_ability(model, SupportsStaticDecode)
        pool = self.model.slot_pool
        if pool is None:
            raise RuntimeError("capture needs the model's slot pool (enable_slot_pool)")
        self.device = device
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.scratch_slot = int(pool.scratch_slot)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_bs,), self.scratch_slot, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_time_s = 0.0

    def capture(self) -> None:
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        mempool = torch.cuda.graph_pool_handle()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                args = (self.input_ids[:bs], self.positions[:bs], self.slots[:bs])
                for _ in range(_WARMUP_RUNS):
                    # A kernel that fails to build is turned off here, before any capture.
                    run_with_kernel_fallback(
                        lambda a=args: self.model.static_decode(*a), f"graph warm-up bs={bs}"
                    )
                graph = torch.cuda.CUDAGraph()
                set_graph_pool_id(mempool)
                try:
                    with torch.cuda.graph(graph, pool=mempool, stream=stream):
                        self.outputs[bs] = self.model.static_decode(*args)
                finally:
                    set_graph_pool_id(None)
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - started

    def padded_size(self, bs: int) -> int:
        """The captured size a batch of ``bs`` rows runs at."""
        i = bisect.bisect_left(self.batch_sizes, bs)
        if i == len(self.batch_sizes):
            raise ValueError(f"batch of {bs} exceeds the largest captured size {self.max_bs}")
        return self.batch_sizes[i]

    def can_run(self, bs: int) -> bool:
        return 1 <= bs <= self.max_bs

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, V]`` for ``B`` real rows (a :data:`StaticStep`)."""
        bs = input_ids.shape[0]
        size = self.padded_size(bs)
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.slots[:bs].copy_(slots)
        if size > bs:  # a larger batch may have left real slots in these rows
            self.input_ids[bs:size].zero_()
            self.positions[bs:size].zero_()
            self.slots[bs:size].fill_(self.scratch_slot)
        self.graphs[size].replay()
        return self.outputs[size][:bs]

    def describe(self) -> str:
        sizes = self.batch_sizes
        shown = (
            ", ".join(map(str, sizes))
            if len(sizes) <= 8
            else (f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}")
        )
        return f"on (decode batch sizes {shown}; captured in {self.capture_time_s:.1f}s)"
