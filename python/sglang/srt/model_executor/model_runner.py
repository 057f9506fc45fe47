"""One TP rank's model: loaded shard, per-request caches, and the forward of a :class:`ForwardPlan`.

Caches are plain per-request objects held in a dict keyed by request id; dropping the entry frees
the request's memory (KV window ring, compressed entries, indexer keys). All ranks apply the same
plan, so their dicts hold the same keys and their caches the same lengths.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.model_registry import LoadOptions, find_model, read_model_config
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs, tp_rank: int, tp_size: int) -> None:
        assert args.model_path is not None and args.device is not None
        self.args = args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = (
            torch.device("cuda", tp_rank) if args.device == "cuda" else torch.device("cpu")
        )
        self.hf_config = read_model_config(args.model_path)
        self.entry = find_model(self.hf_config)
        self.moe_a2a_backend = args.moe_a2a_backend
        started = time.perf_counter()
        self.model = self.entry.load(
            args.model_path,
            LoadOptions(
                dtype=torch_dtype(args.dtype),
                device=self.device,
                tp_rank=tp_rank,
                tp_size=tp_size,
                moe_runner=args.moe_runner_backend,
                a2a_backend=args.moe_a2a_backend,
            ),
        )
        self.load_time_s = time.perf_counter() - started
        self.caches: dict[str, Any] = {}

    # --- facts ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.model.config.max_position_embeddings)

    def moe_runner_name(self) -> str:
        """The runner the MoE layers actually use (``auto`` resolved)."""
        for module in self.model.modules():
            runner = getattr(module, "runner", None)
            if runner is not None and hasattr(runner, "run"):
                return str(getattr(runner, "name", type(runner).__name__))
        return self.args.moe_runner_backend

    # --- caches --------------------------------------------------------------------------------

    def cache_len(self, rid: str) -> int:
        return len(self.caches[rid])

    # --- forward -------------------------------------------------------------------------------

    def execute(self, plan: ForwardPlan) -> torch.Tensor | None:
        """Apply the plan's frees and new caches, run its rows; logits ``[T, V]`` or ``None``."""
        for rid in plan.free_rids:
            self.caches.pop(rid, None)
        for rid in plan.new_rids:
            self.caches[rid] = self.model.new_request_cache()
        if not plan.has_forward:
            return None
        caches = [self.caches[rid] for rid in plan.rids]
        positions = torch.cat(
            [
                torch.arange(len(c), len(c) + n, dtype=torch.long)
                for c, n in zip(caches, plan.seq_lens)
            ]
        )
        ids = torch.tensor(plan.input_ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True)
        batch = self.entry.make_batch(plan.seq_lens, caches)
        return self.model.forward(ids, positions, batch)

    def warmup(self, num_tokens: int = 16) -> None:
        """One prefill and one decode on a throw-away cache, identical on every rank: compiles
        kernels and settles allocator state before serving (and before symmetric-memory pool
        preallocation)."""
        n = min(num_tokens, self.max_position_embeddings - 1)
        cache = self.model.new_request_cache()
        ids = (torch.arange(n, dtype=torch.long) % self.vocab_size).to(self.device)
        self.model.forward(
            ids, torch.arange(n, device=self.device), self.entry.make_batch([n], [cache])
        )
        self.model.forward(
            ids[:1], torch.tensor([n], device=self.device), self.entry.make_batch([1], [cache])
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
