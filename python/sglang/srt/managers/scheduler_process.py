"""Entry point of one scheduler / model-worker process (one per TP rank).

Order matters: symmetric memory is enabled before NCCL starts (it sets NCCL_CUMEM_ENABLE), the
model is warmed up on every rank, budgets are agreed across ranks, then the decode slot pool is
preallocated and the decode CUDA graphs captured, and only then is the symmetric pool preallocated
(no registration during capture or while serving) and rank 0 reports ready.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import ModelInfo
from sglang.srt.managers.output_constraints import grammar_backend_in_use, make_grammar_compiler
from sglang.srt.managers.scheduler import LostPeerError
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

# Long enough for first-use kernel compilation on one rank while the others wait in a collective
# (--dist-timeout overrides it).
_PROCESS_GROUP_TIMEOUT = timedelta(hours=2)


def _group_timeout(args: ServerArgs) -> timedelta:
    if args.dist_timeout is None:
        return _PROCESS_GROUP_TIMEOUT
    return timedelta(seconds=args.dist_timeout)


def _heartbeat_s(args: ServerArgs) -> float:
    """Idle rank 0 broadcasts at least this often: well inside the followers' group timeout."""
    return min(envs.SGLANG_DIST_HEARTBEAT_S.get(), _group_timeout(args).total_seconds() / 3)


def _init_distributed(args: ServerArgs, tp_rank: int, init_method: str, backend: str) -> None:
    """Join the other ranks. One node: the launcher's file store. Several: node 0's TCP store at
    --dist-init-addr, within SGLANG_DIST_JOIN_TIMEOUT_S, so a node that never comes (or a node 0
    that is not there) fails every node that did with an error saying so, never a hang."""
    from sglang.srt.distributed import parallel_state as ps

    local_rank = tp_rank - args.local_ranks.start
    if args.nnodes == 1:
        join = _group_timeout(args)
    else:
        join = timedelta(seconds=envs.SGLANG_DIST_JOIN_TIMEOUT_S.get())
    try:
        ps.init_distributed_environment(
            args.tp_size,
            tp_rank,
            backend=backend,
            init_method=init_method,
            local_rank=local_rank,
            timeout=join,
            group_timeout=_group_timeout(args),
        )
    except Exception as exc:
        if args.nnodes == 1:
            raise
        text = str(exc).strip()
        reason = (text.splitlines()[0] if text else type(exc).__name__).rstrip(".")
        raise RuntimeError(
            f"node {args.node_rank} of --nnodes {args.nnodes}: the ranks did not all join at "
            f"--dist-init-addr {args.dist_init_addr} within {join.total_seconds():.0f}s "
            f"(SGLANG_DIST_JOIN_TIMEOUT_S): {reason}. Start launch_server on every node with "
            f"the same --tp-size/--nnodes/--dist-init-addr and its own --node-rank"
        ) from None


def _eos_token_ids(model_path: str, hf_config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (int or list in either)."""
    import json
    import os

    found: list[int] = []
    sources = [hf_config]
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen, encoding="utf-8") as f:
            sources.append(json.load(f))
    for src in sources:
        value = src.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)
    return found


def _cpu_threads(tp_size: int) -> int:
    """Oversubscribed OpenMP pools spin against each other (and against the HTTP process, and
    inside every gloo all-reduce), which makes CPU serving many times slower; so leave a core free
    and split the rest over the ranks."""
    configured = envs.SGLANG_CPU_THREADS.get()
    if configured:
        return configured
    return max(1, min(16, ((os.cpu_count() or 1) - 1) // tp_size))


def _default_max_total_tokens(
    args: ServerArgs, runner: Any, context_length: int, *, log: bool
) -> int:
    """The budget from the model's memory model and the GPU memory the weights left; without a
    GPU or a memory model the worst case (context x max running requests)."""
    from sglang.srt.model_executor.memory_budget import (
        logits_reservation_note,
        max_total_tokens_for_memory,
        memory_model_of,
        weights_note,
    )
    from sglang.srt.model_loader.resident_weights import resident_weight_bytes

    assert args.max_running_requests is not None and args.chunked_prefill_size is not None
    worst = context_length * args.max_running_requests
    if runner.device.type != "cuda":
        return worst
    assert args.max_logit_rows_per_step is not None
    shape = memory_model_of(runner.model)
    if shape is None:
        logger.warning(
            f"no memory model for {runner.entry.architecture} ({type(runner.model).__name__} "
            "has no memory_model()); --max-total-tokens defaults to context length x max "
            "running requests: set it to bound memory"
        )
        return worst
    free, total = torch.cuda.mem_get_info(runner.device)
    room = int(total * args.mem_fraction_static) - (total - free)
    if log and isinstance(runner.model, torch.nn.Module):
        logger.info(weights_note(resident_weight_bytes(runner.model), total - free))
    chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else context_length
    # Under DP attention each group computes up to the cap and rank 0 receives every group's
    # rows; every rank reserves that (the smallest rank's budget is everyone's anyway).
    dp = args.dp_size if args.enable_dp_attention else 1
    rows = args.max_logit_rows_per_step * dp
    if log:
        note = logits_reservation_note(
            shape,
            logit_rows=rows,
            chunked_prefill_size=chunk,
            max_running_requests=args.max_running_requests,
        )
        logger.info(note + (f" ({dp} DP groups' rows, gathered on rank 0)" if dp > 1 else ""))
    tokens = max_total_tokens_for_memory(
        shape,
        room_bytes=room,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=chunk,
        context_length=context_length,
        max_logit_rows=rows,
        state_snapshots=_state_snapshots(args),
    )
    if log:
        capped = " (the cap: context x max running)" if tokens == worst else ""
        logger.info(
            f"default --max-total-tokens {tokens}{capped}: {type(runner.model).__name__}'s memory "
            f"model, {shape.describe()}, in {room / (1 << 30):.2f} GiB of "
            f"--mem-fraction-static {args.mem_fraction_static} the weights left"
        )
    return tokens


def _kv_cache_line(runner: Any, budget: int, context_length: int) -> str:
    """The startup line on the KV cache: its layout (bytes a row of each kind), what a cached
    token costs per layer kind (the memory model) and the capacity that follows."""
    from sglang.srt.model_executor.memory_budget import memory_model_of

    shape = memory_model_of(runner.model)
    cost = f"; {shape.describe()}" if shape is not None else ""
    return (
        f"{runner.kv_cache_layout()}{cost}; capacity {budget} cached tokens "
        f"({budget // max(context_length, 1)} requests of the whole {context_length}-token "
        "context)"
    )


def _state_snapshots(args: ServerArgs) -> int:
    """The prefix cache's snapshot rows (0: --disable-radix-cache)."""
    return 0 if args.disable_radix_cache else args.max_state_snapshots or 0


def _enable_prefix_cache(args: ServerArgs, runner: Any, block_tokens: int) -> tuple[int, str]:
    """The prefix cache's snapshot rows on this rank (0: off) and the startup line's words."""
    if args.disable_radix_cache:
        return 0, "off (--disable-radix-cache)"
    why = runner.prefix_cache_unavailable_reason()
    rows = _state_snapshots(args)
    if why is not None or rows < 1:
        return 0, f"off ({why or '--max-state-snapshots 0'})"
    store = runner.enable_prefix_cache(rows)
    per = store.snapshots.row_bytes() / (1 << 20)
    return rows, (
        f"on (radix tree over {block_tokens}-token blocks, {rows} state snapshots of "
        f"{per:.2f} MiB, --schedule-policy {args.schedule_policy})"
    )


def check_dp_attention(args: ServerArgs, hf_config: dict[str, Any] | None = None) -> None:
    """Before the load: a model that cannot serve DP attention fails with its reason
    (``hf_config``: the config.json dict, when the caller read it already)."""
    from sglang.srt.models.config_common import read_config_json
    from sglang.srt.models.registry import dp_attention_unsupported_reason, find_model

    assert args.model_path is not None
    config = hf_config if hf_config is not None else read_config_json(args.model_path)
    why = dp_attention_unsupported_reason(find_model(config))
    if why is not None:
        raise RuntimeError(f"--enable-dp-attention --dp-size {args.dp_size}: {why}")


def _layout(args: ServerArgs) -> str:
    """``TP=4``, ``TP=4 EP=2 (experts sliced over 2 ranks)`` or ``TP=4 DP=2 (attention TP=2) over
    2 nodes`` for the startup log."""
    text = f"TP={args.tp_size}"
    if args.ep_size > 1:
        text += f" EP={args.ep_size}"
        if args.ep_size < args.tp_size:
            text += f" (experts sliced over {args.tp_size // args.ep_size} ranks)"
    if args.enable_dp_attention:
        text += f" DP={args.dp_size} (attention TP={args.attn_tp_size})"
    if args.nnodes > 1:
        text += f" over {args.nnodes} nodes at {args.dist_init_addr}"
    return text


def _symm_mem_state(args: ServerArgs, tp_size: int) -> str:
    if not args.enable_symm_mem:
        return "off"
    return "on" if tp_size > 1 else "on (no effect with one rank)"


def _sm_budget(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget

    return mega_moe_sm_budget(device)


def _share_seed(args: ServerArgs, tp_rank: int) -> ServerArgs:
    """``args`` with rank 0's seed. Every node resolves its own ``--random-seed`` (random when
    omitted), so on ``--nnodes N`` the nodes would disagree; node 0's is the one every rank
    uses (one object broadcast over the world group's gloo group at startup)."""
    from sglang.srt.distributed.parallel_state import get_world_group

    if args.nnodes == 1:  # one launcher resolved the seed for every rank
        return args
    seed = get_world_group().broadcast_object(args.random_seed, src=0)
    if args.nnodes > 1 and tp_rank == args.local_ranks.start and args.node_rank > 0:
        logger.info(
            f"node {args.node_rank} of {args.nnodes}: sampling seed {seed} (node 0's; this "
            f"node resolved {args.random_seed})"
        )
    return dataclasses.replace(args, random_seed=seed)


def run_scheduler_process(
    args: ServerArgs,
    tp_rank: int,
    init_method: str,
    recv: Connection | None,
    send: Connection | None,
    status: Any,
) -> None:
    # Ctrl-C reaches the whole process group, and a supervisor may SIGTERM every process of the
    # group; the launching process owns the orderly shutdown (it drains requests, then asks
    # rank 0, which tells the other ranks), so the workers ignore both. SIGKILL still ends one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.getLogger("sglang").setLevel(args.log_level.upper())
    tp_size = args.tp_size
    dp_size = args.dp_size if args.enable_dp_attention else 1
    started = False
    try:
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.distributed.symm_mem.allocator import (
            prealloc_symmetric_memory_pool,
            set_symmetric_memory_enabled,
        )
        from sglang.srt.layers.dp_attention import set_dp_attention_config
        from sglang.srt.managers.scheduler import Scheduler, run_follower
        from sglang.srt.model_executor.model_runner import ModelRunner

        on_gpu = args.device == "cuda"
        if not on_gpu:
            torch.set_num_threads(_cpu_threads(len(args.local_ranks)))
        if args.enable_symm_mem:
            set_symmetric_memory_enabled(True)  # before NCCL's first init
        _init_distributed(args, tp_rank, init_method, "nccl" if on_gpu else "gloo")
        args = _share_seed(args, tp_rank)
        assert args.random_seed is not None
        torch.manual_seed(args.random_seed)
        tp_group = ps.initialize_model_parallel(tp_size, attention_dp_size=dp_size)
        set_dp_attention_config(
            args.enable_dp_attention, dp_size=dp_size, attn_tp_size=tp_size // dp_size
        )
        from sglang.srt.models.config_common import read_config_json

        assert args.model_path is not None
        hf_config = read_config_json(args.model_path)  # once a rank: everything below reuses it
        if args.enable_dp_attention:
            check_dp_attention(args, hf_config)
        runner = ModelRunner(args, tp_rank, tp_size, hf_config=hf_config)
        runner.warmup()
        context_length = min(
            args.context_length or runner.max_position_embeddings, runner.max_position_embeddings
        )
        if args.context_length is not None and args.context_length > runner.max_position_embeddings:
            logger.warning(
                f"--context-length {args.context_length} exceeds the model's "
                f"max_position_embeddings {runner.max_position_embeddings}; using the latter"
            )
        budget = args.max_total_tokens or _default_max_total_tokens(
            args, runner, context_length, log=tp_rank == 0
        )
        # Every rank holds the same caches, so the smallest rank's budget is everyone's.
        budget = min(tp_group.all_gather_object(budget))
        assert args.max_running_requests is not None and args.chunked_prefill_size is not None
        # Slot pool and decode graphs, then the symmetric pool's preallocation (after capture).
        decode = runner.init_decode(
            context_length=context_length,
            max_total_tokens=budget,
            max_running_requests=args.max_running_requests,
        )
        snapshots, prefix_cache = _enable_prefix_cache(args, runner, decode.block_tokens)
        if args.enable_symm_mem and on_gpu and tp_size > 1:
            prealloc_symmetric_memory_pool(tp_group)
        max_running = decode.max_running_requests
        # Paged: the pool's whole blocks are the token budget the scheduler admits by.
        budget = decode.max_total_tokens or budget
        if max_running < args.max_running_requests and tp_rank == 0:
            logger.warning(
                f"--max-running-requests {args.max_running_requests} lowered to {max_running}: "
                f"the cache slots of {context_length}-token requests that fit --max-total-tokens "
                f"{budget}"
            )
        if tp_rank == 0:
            logger.info(_kv_cache_line(runner, budget, context_length))
        moe_runner = runner.moe_runner_name()
        sm_budget = _sm_budget(runner.device)
        symm = _symm_mem_state(args, tp_size)
        cuda_graph = decode.cuda_graph
        mega = runner.mega_moe_backend()
        if tp_rank == 0 and mega is not None:
            logger.info(f"MegaMoE kernel: {mega}")
        if tp_rank == 0:
            logger.info(
                f"ready: {runner.entry.architecture} from {args.model_path} on {args.device} "
                f"({_layout(args)}, {args.dtype}, loaded in {runner.load_time_s:.1f}s); "
                f"MoE runner: {moe_runner} (requested {args.moe_runner_backend}), "
                f"a2a: {args.moe_a2a_backend}; MegaMoE SM budget: "
                f"{sm_budget if sm_budget is not None else 'n/a (no CUDA device)'}; "
                f"symmetric memory: {symm}; CUDA graphs: {cuda_graph}; "
                f"prefix cache: {prefix_cache}; "
                f"context {context_length}, max total tokens {budget}, "
                f"max running requests {max_running}, "
                f"chunked prefill {args.chunked_prefill_size}, "
                f"logit rows per step {args.max_logit_rows_per_step}"
            )
        info = ModelInfo(
            model_path=args.model_path or "",
            architecture=runner.entry.architecture,
            vocab_size=runner.vocab_size,
            context_length=context_length,
            eos_token_ids=_eos_token_ids(args.model_path or "", runner.hf_config),
            max_total_tokens=budget,
            max_running_requests=max_running,
            chunked_prefill_size=args.chunked_prefill_size,
            dtype=args.dtype,
            device=args.device or "cpu",
            moe_runner=moe_runner,
            moe_a2a_backend=args.moe_a2a_backend,
            symm_mem=symm,
            mega_moe_sm_budget=sm_budget,
            cuda_graph=cuda_graph,
            kv_cache_dtype=runner.kv_cache_dtype(),
            prefix_cache=prefix_cache,
        )
        status.put(("ready", tp_rank, info if tp_rank == 0 else None))
        started = True
        if tp_rank == 0:
            assert recv is not None and send is not None
            Scheduler(
                runner,
                tp_group,
                context_length=context_length,
                eos_token_ids=info.eos_token_ids,
                max_total_tokens=budget,
                max_running_requests=max_running,
                chunked_prefill_size=args.chunked_prefill_size,
                random_seed=args.random_seed,
                recv=recv,
                send=send,
                heartbeat_s=_heartbeat_s(args),
                dp_size=dp_size,
                block_tokens=decode.block_tokens,
                max_logit_rows=args.max_logit_rows_per_step,
                log_stats_interval_s=args.log_stats_interval,
                state_snapshots=snapshots,
                schedule_policy=args.schedule_policy,
                max_request_tokens=decode.max_request_tokens,
                grammar_compiler=make_grammar_compiler(
                    grammar_backend_in_use(args.grammar_backend),
                    None if args.skip_tokenizer_init else args.tokenizer_path or args.model_path,
                    runner.vocab_size,
                    info.eos_token_ids,
                ),
            ).run()
        else:
            run_follower(runner, tp_group)
        ps.destroy_distributed_environment()
    except LostPeerError as exc:  # logged where it was seen; no traceback for a dead peer
        if not started:
            status.put(("error", tp_rank, str(exc), traceback.format_exc()))
        elif tp_rank != 0:
            logger.error(f"{exc}; exiting")
        sys.exit(1)
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        if not started:
            # The launcher prints one message for all ranks (the traceback once, at debug level);
            # exiting through SystemExit keeps multiprocessing from printing it again per rank.
            status.put(("error", tp_rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        else:
            logger.exception(f"scheduler rank {tp_rank} failed while serving")
        sys.exit(1)
