"""One TP rank's model: loaded shard, per-request caches, and the forward of a :class:`ForwardPlan`.

Caches are per-request objects held in a dict keyed by request id. By default each owns its
tensors and dropping the entry frees them. When :meth:`ModelRunner.init_decode` finds the token
budget a bound (``--max-total-tokens``, or the model's memory model on the GPU), caches live in
slots of the model's preallocated pool instead, their growing state in its blocks: freeing a
request returns its slot and blocks, and prefill chunks run eagerly into the slot (taking the
blocks they fill). Decode rows then run eagerly on the pooled caches, or, where the static decode
is taken, replay a captured graph (padded to the next captured size), in a mixed step too
(``mixed_step``). All ranks apply the same plan, so their dicts hold the same keys, slots and
lengths.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.dp_attention import reset_dp_state, set_dp_state_for_warmup
from sglang.srt.mem_cache.block_pool import BlockPool
from sglang.srt.mem_cache.prefix_store import PrefixStore
from sglang.srt.mem_cache.slot_blocks import SlotBlocks
from sglang.srt.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    capture_batch_sizes,
    graph_unavailable_reason,
)
from sglang.srt.model_executor.dp_step import execute_dp_plan
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.kernel_fallback import run_with_kernel_fallback
from sglang.srt.model_executor.memory_budget import unbounded_budget_reason
from sglang.srt.model_executor.mixed_step import MixedSplit, split_mixed_step
from sglang.srt.model_executor.model_abilities import (
    ServedModel,
    SlotPool,
    SupportsKVCacheDtype,
    SupportsSlotPool,
    SupportsStaticDecode,
    moe_runners,
    require_ability,
    static_decode_reason,
)
from sglang.srt.model_executor.slot_plan import SlotPlan, plan_slot_pool
from sglang.srt.model_executor.warmup_plan import warmup_token_counts
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.config_common import read_config_json
from sglang.srt.models.loading import load_model
from sglang.srt.models.registry import find_model
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _local_gpu(tp_rank: int) -> int:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.cuda.current_device()
    return tp_rank


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class DecodeSetup:
    """What :meth:`ModelRunner.init_decode` chose, for the startup log and the scheduler."""

    cuda_graph: str  # "on (...)" or "off (why)", then how the caches are held
    max_running_requests: int  # the pool's slot count caps it when caches are pooled
    # Admission granularity: a request reserves whole blocks of this many tokens (1: no paging),
    # out of ``max_total_tokens`` (the pool's blocks when paged).
    block_tokens: int = 1
    max_total_tokens: int | None = None
    # The most tokens one request may hold (the pool's per-request capacity; None: unpaged).
    max_request_tokens: int | None = None


class ModelRunner:
    def __init__(
        self,
        args: ServerArgs,
        tp_rank: int,
        tp_size: int,
        *,
        hf_config: dict[str, Any] | None = None,
    ) -> None:
        """``hf_config``: the config.json dict when the caller read it already (once a rank)."""
        assert args.model_path is not None and args.device is not None
        self.args = args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # On CUDA the process's device was set from its local rank (several nodes: tp_rank is
        # global) when torch.distributed started; one process without it uses cuda:tp_rank.
        self.device = (
            torch.device("cuda", _local_gpu(tp_rank))
            if args.device == "cuda"
            else torch.device("cpu")
        )
        self.hf_config = hf_config if hf_config is not None else read_config_json(args.model_path)
        self.entry = find_model(self.hf_config)
        started = time.perf_counter()
        self.dtype = torch_dtype(args.dtype)
        spec = LayerBuildSpec(
            dtype=self.dtype,
            device=self.device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            moe_runner=args.moe_runner_backend,
            a2a_backend=args.moe_a2a_backend,
            moe_ep_size=args.ep_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        opts = LoadOptions(progress=tp_rank == 0)
        loaded = load_model(args.model_path, spec, opts, config=self.hf_config)
        self.model: ServedModel = require_ability(loaded, ServedModel)
        if args.kv_cache_dtype == "fp8_e4m3" and not isinstance(loaded, SupportsKVCacheDtype):
            raise ValueError(
                f"--kv-cache-dtype fp8_e4m3: {type(loaded).__name__} has no FP8 cache layout; "
                "use --kv-cache-dtype auto or bf16"
            )
        self.load_time_s = time.perf_counter() - started
        self.caches: dict[str, Any] = {}
        # Set by init_decode when caches live in the model's slot pool (paged, preallocated).
        self.pool_model: SupportsSlotPool | None = None
        # Set as well when decode rows go through the pool's static decode (graphs or padded).
        self.static_model: SupportsStaticDecode | None = None
        self.graph_runner: CudaGraphRunner | None = None
        # Set by enable_prefix_cache: the blocks and state snapshots the prefix cache keeps.
        self.prefix_store: PrefixStore | None = None
        # Static decode without graphs: the sizes a batch pads to (those graphs would capture).
        self.static_sizes: list[int] = []

    # --- facts ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def pooled(self) -> bool:
        """Caches live in the model's slot pool (decoded eagerly or through ``static_decode``)."""
        return self.pool_model is not None

    def kv_cache_dtype(self) -> str:
        """What ``--kv-cache-dtype`` resolved to for this model (``bf16``: the model dtype)."""
        if isinstance(self.model, SupportsKVCacheDtype):
            return self.model.kv_layout.choice.name
        return "bf16"

    def kv_cache_layout(self) -> str:
        """The startup log's line on how the caches store their rows."""
        if isinstance(self.model, SupportsKVCacheDtype):
            return self.model.kv_layout.describe()
        return f"KV cache in the model dtype ({type(self.model).__name__} has no FP8 layout)"

    def moe_runner_name(self) -> str:
        """The runner the MoE layers actually use (``auto`` resolved)."""
        for runner in moe_runners(self.model):
            return runner.name
        return self.args.moe_runner_backend

    def mega_moe_backend(self) -> str | None:
        """The fused kernel the MoE layers' a2a backend runs (``--moe-a2a-backend megamoe``),
        and why; None when the runner takes every batch."""
        for layer in self.model.moe_layers():
            return layer.mega_backend_summary(self.dtype)
        return None

    # --- decode setup --------------------------------------------------------------------------

    def init_decode(
        self,
        *,
        context_length: int,
        max_total_tokens: int,
        max_running_requests: int,
        static_without_graphs: bool = False,
    ) -> DecodeSetup:
        """Before serving (after warm-up, before the symmetric pool's preallocation): when decode
        can run in CUDA graphs, preallocate the slot pool and capture; otherwise decode eagerly,
        on the slot pool when the budget is a bound (:meth:`_init_eager_decode`).
        ``static_without_graphs`` (or ``SGLANG_STATIC_DECODE_WITHOUT_GRAPHS``) runs the static
        decode eagerly where graphs are unavailable, padded to the sizes graphs would capture, so
        that it is the exact A/B of a graph replay (tests on CPU; graphs == eager on the GPU)."""
        if self.args.enable_dp_attention:  # padded static rows would break the planned sizes
            why = "DP attention: the gathered sizes change every step; decode runs eagerly"
            return self._init_eager_decode(
                f"off ({why})", context_length, max_total_tokens, max_running_requests
            )
        reason = graph_unavailable_reason(
            self.model, self.device, disabled=self.args.disable_cuda_graph
        )
        static_why = self._static_decode_reason()
        reason = reason or static_why
        static_without_graphs |= envs.SGLANG_STATIC_DECODE_WITHOUT_GRAPHS.get()
        if reason is not None and not (static_without_graphs and static_why is None):
            off = reason
            if isinstance(self.model, SupportsStaticDecode) and static_why not in (None, reason):
                off = f"{reason}; {static_why}"  # why its static decode is not taken either
            return self._init_eager_decode(
                f"off ({off})", context_length, max_total_tokens, max_running_requests
            )
        static = require_ability(self.model, SupportsStaticDecode)
        plan = plan_slot_pool(
            context_length=context_length,
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
        )
        pool = self._enable_slot_pool(static, plan)
        self.pool_model = self.static_model = static
        gib = pool.nbytes() / (1 << 30)
        blocks = pool.block_pool
        slots = (
            f"slot pool {plan.slots} slots of up to {plan.capacity} tokens, paged in "
            f"{blocks.num_blocks} blocks of {blocks.block_tokens} tokens, {gib:.2f} GiB"
        )
        paged = {
            "block_tokens": blocks.block_tokens,
            "max_total_tokens": blocks.num_blocks * blocks.block_tokens,
            "max_request_tokens": plan.capacity,
        }
        sizes = capture_batch_sizes(min(self.args.cuda_graph_max_bs or plan.slots, plan.slots))
        if reason is not None:
            self.static_sizes = sizes
            return DecodeSetup(
                f"off ({reason}); static decode eager at the graph batch sizes, {slots}",
                plan.slots,
                **paged,
            )
        self.graph_runner = CudaGraphRunner(static, sizes, self.device)
        self.graph_runner.capture()
        return DecodeSetup(f"{self.graph_runner.describe()}; {slots}", plan.slots, **paged)

    def _static_decode_reason(self) -> str | None:
        """Why decode must not go through the model's static decode (None: it may): it has none,
        its gate is closed (Kimi K3: ``SGLANG_K3_STATIC_DECODE``), or it pages and the budget is
        the worst case (no ``--max-total-tokens``, and no memory model or no GPU to measure),
        which the slot pool would preallocate."""
        why = static_decode_reason(self.model)
        if why is not None:
            return why
        unbounded = self._unbounded_budget_reason()
        if isinstance(self.model, SupportsSlotPool) and unbounded is not None:
            return (
                f"the static decode of {type(self.model).__name__} preallocates its paged caches "
                f"and the default budget is the worst case ({unbounded}): set --max-total-tokens "
                "to take it"
            )
        return None

    def _unbounded_budget_reason(self) -> str | None:
        """Why the token budget is not a bound (None: the user gave ``--max-total-tokens`` or
        the scheduler measured it with the model's memory model)."""
        if self.args.max_total_tokens is not None:
            return None
        return unbounded_budget_reason(self.model, self.device)

    def _init_eager_decode(
        self, graphs: str, context_length: int, max_total_tokens: int, max_running_requests: int
    ) -> DecodeSetup:
        """Decode eagerly; page the caches in the model's slot pool, blocks worth
        ``max_total_tokens``, when the model has one and that is a bound (``--max-total-tokens``,
        or the model's memory model on the GPU): otherwise the default budget (context x max
        running) is the worst case, which preallocating would turn from a bound into an
        allocation, and caches stay per request."""
        if not isinstance(self.model, SupportsSlotPool):
            return DecodeSetup(graphs, max_running_requests)
        unbounded = self._unbounded_budget_reason()
        if unbounded is not None:
            how = (
                ""
                if "--max-total-tokens" in graphs
                else f" (set --max-total-tokens to page them: {unbounded})"
            )
            return DecodeSetup(f"{graphs}; caches per request{how}", max_running_requests)
        plan = plan_slot_pool(
            context_length=context_length,
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
        )
        pool = self._enable_slot_pool(self.model, plan)
        self.pool_model = self.model
        blocks = pool.block_pool
        gib = pool.nbytes() / (1 << 30)
        return DecodeSetup(
            f"{graphs}; caches paged in {blocks.num_blocks} blocks of {blocks.block_tokens} "
            f"tokens, {gib:.2f} GiB",
            plan.slots,
            block_tokens=blocks.block_tokens,
            max_total_tokens=blocks.num_blocks * blocks.block_tokens,
            max_request_tokens=plan.capacity,
        )

    def _enable_slot_pool(self, model: SupportsSlotPool, plan: SlotPlan) -> SlotPool:
        """The model's slot pool for ``plan``, in blocks of ``--page-size`` tokens if given."""
        try:
            return model.enable_slot_pool(
                plan.slots,
                plan.capacity,
                total_tokens=plan.total_tokens,
                block_tokens=self.args.page_size,
            )
        except ValueError as exc:
            if self.args.page_size is None:
                raise
            raise ValueError(f"--page-size {self.args.page_size}: {exc}") from None

    def block_pool(self) -> BlockPool | None:
        """The slot pool's blocks (None: caches are per request)."""
        return None if self.pool_model is None else self.pool_model.slot_pool.block_pool

    # --- prefix cache --------------------------------------------------------------------------

    def prefix_cache_unavailable_reason(self) -> str | None:
        """Why this rank cannot keep a prefix cache (None: it can): the cache shares the slot
        pool's blocks, so the caches must be pooled."""
        if self.pool_model is None:
            return "the request caches are not paged in a slot pool (see the CUDA graph line)"
        return None

    def enable_prefix_cache(self, snapshot_rows: int) -> PrefixStore:
        """Keep cached prefixes in the slot pool's blocks, with ``snapshot_rows`` copies of the
        per-request state at block edges (after :meth:`init_decode`)."""
        why = self.prefix_cache_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"no prefix cache: {why}")
        assert self.pool_model is not None
        pool = self.pool_model.slot_pool
        if not isinstance(pool, SlotBlocks):
            raise TypeError(f"{type(pool).__name__} is not a paged slot pool (SlotBlocks)")
        self.prefix_store = PrefixStore(pool, snapshot_rows)
        return self.prefix_store

    # --- forward -------------------------------------------------------------------------------

    def execute(self, plan: ForwardPlan) -> torch.Tensor | None:
        """Apply the plan's frees and new caches, run its rows; the logits of its ``output_rows``
        (``[len(output_rows), V]``) or ``None``. A DP-attention plan runs this rank's group
        (``dp_step``): every group's logit rows on rank 0, ``None`` elsewhere."""
        if plan.dp_plans:
            return execute_dp_plan(self, plan)
        pool, static, store = self.pool_model, self.static_model, self.prefix_store
        if (plan.cache_ops or plan.prefix_hits) and store is None:
            raise RuntimeError("the plan changes the prefix cache, but this rank keeps none")
        if store is not None and plan.cache_ops:  # before the frees: finished requests hand over
            store.apply(plan.cache_ops, self.caches)
        for rid in plan.free_rids:
            cache = self.caches.pop(rid, None)
            if cache is not None and pool is not None:
                pool.free_pooled_cache(cache)
        new = self.model.new_request_cache if pool is None else pool.new_pooled_cache
        for rid in plan.new_rids:
            self.caches[rid] = new()
        for hit in plan.prefix_hits:
            assert store is not None
            store.attach(hit, self.caches[hit.rid])
        if not plan.has_forward:
            return None
        caches = [self.caches[rid] for rid in plan.rids]
        rows = self._logit_rows(plan)
        if static is not None and all(n == 1 for n in plan.seq_lens):
            logits = self._decode_static(static, plan.input_ids, caches)  # one row per request
            return logits if rows is None else logits.index_select(0, rows)
        if static is not None and envs.SGLANG_MIXED_STEP_GRAPHS.get():
            split = split_mixed_step(plan, [len(c) for c in caches])
            if split is not None:
                return self._execute_mixed(static, split, caches)
        return self._forward_eager(plan.input_ids, plan.seq_lens, caches, rows)

    def _forward_eager(
        self,
        input_ids: tuple[int, ...],
        seq_lens: tuple[int, ...],
        caches: list[Any],
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One eager forward of ``seq_lens`` new tokens per cache; the logits of ``rows``."""
        positions = torch.cat(
            [torch.arange(len(c), len(c) + n, dtype=torch.long) for c, n in zip(caches, seq_lens)]
        )
        ids = torch.tensor(input_ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True)
        batch = self.entry.make_batch(list(seq_lens), caches)
        return self.model.forward(ids, positions, batch, logit_rows=rows)

    def _execute_mixed(
        self, static: SupportsStaticDecode, split: MixedSplit, caches: list[Any]
    ) -> torch.Tensor:
        """A mixed step as the static decode of its decode rows, then the eager forward of the
        rest (``mixed_step``); the logits in the plan's output order."""
        log_once(
            logger,
            logging.INFO,
            "mixed prefill + decode steps: the decode rows through the static decode (a graph "
            "replay where captured), the prefill chunks eagerly (SGLANG_MIXED_STEP_GRAPHS=0: one "
            "eager forward)",
        )
        decoded = self._decode_static(static, split.decode_ids, [caches[i] for i in split.decode])
        rows = None
        if split.eager_logit_rows is not None:
            rows = self._device_rows(split.eager_logit_rows)
        eager = self._forward_eager(
            split.eager_ids, split.eager_lens, [caches[i] for i in split.eager], rows
        )
        return torch.cat([decoded, eager]).index_select(0, self._device_rows(split.order))

    def _logit_rows(self, plan: ForwardPlan) -> torch.Tensor | None:
        """The plan's ``logit_rows`` as an index on the device; None when it keeps every row."""
        if not plan.prunes_logits:
            return None
        assert plan.logit_rows is not None
        return self._device_rows(plan.logit_rows)

    def _device_rows(self, rows: tuple[int, ...]) -> torch.Tensor:
        index = torch.tensor(rows, dtype=torch.long)
        return index.to(self.device, non_blocking=True) if self.device.type != "cpu" else index

    def _decode_static(
        self, model: SupportsStaticDecode, input_ids: tuple[int, ...], caches: list[Any]
    ) -> torch.Tensor:
        """One token per request through the slot pool: a graph replay when one is captured
        for the batch size, else the static decode run eagerly."""
        ids = torch.tensor(input_ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids = ids.to(self.device, non_blocking=True)
        graphs = self.graph_runner
        if graphs is not None:
            step = graphs.replay if graphs.can_run(len(caches)) else None
            return model.decode_pooled(ids, caches, step=step)
        return model.decode_pooled(ids, caches, pad_to=self._static_pad(len(caches)))

    def _static_pad(self, bs: int) -> int:
        """The rows a graph replay of ``bs`` would run (``bs`` itself above the largest size)."""
        i = bisect.bisect_left(self.static_sizes, bs)
        return self.static_sizes[i] if i < len(self.static_sizes) else bs

    def _warmup_prefill(self, n: int) -> Any:
        """One prefill of ``n`` tokens on a throw-away cache, which it returns."""
        cache = self.model.new_request_cache()
        ids = (torch.arange(n, dtype=torch.long) % self.vocab_size).to(self.device)
        set_dp_state_for_warmup(n)  # DP attention: every group warms up with the same rows
        batch = self.entry.make_batch([n], [cache])
        # Only the last row's logits, as a served prefill chunk: the mHC head, norm and LM head
        # are torch (no Triton variant to compile per row count), and an 8192-row fp32
        # logits tensor would only leave gigabytes in the allocator.
        last = torch.tensor([n - 1], device=self.device)
        self.model.forward(ids, torch.arange(n, device=self.device), batch, logit_rows=last)
        return cache

    def _warmup_decode(self, n: int, cache: Any) -> None:
        """One decode step after the ``n``-token prefill of ``cache``."""
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        self.model.forward(
            ids, torch.tensor([n], device=self.device), self.entry.make_batch([1], [cache])
        )

    def warmup(self, num_tokens: int = 16) -> None:
        """Prefills and one decode on throw-away caches, identical on every rank: compiles
        kernels and settles allocator state before serving (and before symmetric-memory pool
        preallocation). On CUDA every token count of :func:`warmup_token_counts` up to the
        prefill chunk is prefilled, so no Triton variant compiles inside a served request."""
        limit = min(num_tokens, self.max_position_embeddings - 1)
        counts = [limit]
        if self.device.type == "cuda":
            chunk = self.args.chunked_prefill_size or 0
            longest = min(chunk if chunk > 0 else 8192, self.max_position_embeddings - 1)
            counts = warmup_token_counts(max(longest, limit))
        for n in counts:
            # A kernel that fails to build here is turned off and the prefill runs again on a
            # fresh cache (kernel_fallback.py).
            cache = run_with_kernel_fallback(lambda n=n: self._warmup_prefill(n), "warm-up")
        set_dp_state_for_warmup(1)
        fresh = [cache]  # a retry decodes after a new prefill: the failed step may have written
        run_with_kernel_fallback(
            lambda: self._warmup_decode(n, fresh.pop() if fresh else self._warmup_prefill(n)),
            "warm-up decode",
        )
        reset_dp_state()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
