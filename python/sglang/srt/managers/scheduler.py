"""The scheduler loop of rank 0 and the follower loop of the other TP ranks.

Rank 0 receives requests from the tokenizer manager, picks each step's work
(:class:`SchedulePolicy`), broadcasts the :class:`ForwardPlan` over the gloo CPU group, runs its
share of the forward like every rank, samples the next tokens (its logits are complete: the LM head
is replicated), and sends the new tokens up. Followers only receive plans and run forwards.
"""

from __future__ import annotations

import os
import re
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from sglang.srt.constrained.grammar_compiler import GrammarCompiler
from sglang.srt.environ import envs
from sglang.srt.managers.dp_schedule_policy import (
    BALANCE_POLICY,
    PREFIX_POLICY,
    DpSchedulePolicy,
)
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchOutput,
    FinishReason,
    FlushCacheReq,
    FlushCacheResult,
    ReqError,
    ReqOutput,
    SchedulerFailed,
    SchedulerStats,
    ShutdownReq,
    StatsReq,
    TokenizedGenerateReq,
)
from sglang.srt.managers.output_constraints import GrammarQueue, advance, step_constraints
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy, Step, StepRow
from sglang.srt.managers.step_log import StepLog
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampler import SampleOutput, SamplingRow, make_generator, sample
from sglang.srt.sampling.token_bitmask import BitmaskBuffer
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

# An idle leader broadcasts an empty plan this often (SGLANG_DIST_HEARTBEAT_S), so followers
# blocked in the broadcast never reach the process group's timeout however long the server sits
# idle, and a follower (or a node) that went away is noticed even when no request comes.
_HEARTBEAT_S = 30.0
# How often a scheduler with nothing to run checks for compiled grammars.
_GRAMMAR_POLL_S = 0.002


class LostPeerError(RuntimeError):
    """A collective with the other ranks failed: a rank or a node died, or the network failed."""


def is_transport_failure(exc: BaseException) -> bool:
    """A collective failed because a peer went away (not a bug of this rank's forward)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return "gloo/transport" in text or "by peer" in text or "NCCL communicator was aborted" in text


def _lost_peer(what: str, exc: BaseException) -> LostPeerError:
    # gloo's text: "[.../pair.cc:553] Connection closed by peer [ip]:port. This is typically..."
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")
    return LostPeerError(
        f"{what} lost contact with the other scheduler ranks ({reason}); a rank or a node died "
        "or the network between the nodes failed"
    )


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        tp_group: Any,
        *,
        context_length: int,
        eos_token_ids: list[int],
        max_total_tokens: int,
        max_running_requests: int,
        chunked_prefill_size: int,
        random_seed: int,
        recv: Connection,
        send: Connection,
        heartbeat_s: float = _HEARTBEAT_S,
        dp_size: int = 1,
        block_tokens: int = 1,
        max_logit_rows: int | None = None,
        log_stats_interval_s: float = 0.0,
        state_snapshots: int = 0,
        schedule_policy: str = "fcfs",
        max_request_tokens: int | None = None,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """``state_snapshots`` > 0 (with a paged pool, ``block_tokens`` > 1) turns the prefix
        cache on: the snapshot rows each rank's prefix store keeps."""
        self.runner = runner
        self.step_log = StepLog(log_stats_interval_s)
        self.heartbeat_s = heartbeat_s
        self.tp_group = tp_group
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        budget = {
            "max_running_requests": max_running_requests,
            "max_total_tokens": max_total_tokens,
            "chunked_prefill_size": chunked_prefill_size,
            "max_logit_rows": max_logit_rows,
            "max_request_tokens": max_request_tokens,
        }

        def new_tree() -> RadixCache:
            return RadixCache(block_tokens, state_snapshots)

        radix = new_tree if state_snapshots > 0 and block_tokens > 1 else None
        order = {"schedule_policy": schedule_policy, "block_tokens": block_tokens}
        self.policy: SchedulePolicy | DpSchedulePolicy = SchedulePolicy(
            **budget,
            **order,
            prefix_cache=None if radix is None else radix(),
            lpm_max_wait_s=envs.SGLANG_LPM_MAX_WAIT_S.get(),
        )
        if block_tokens > 1:
            logger.info(
                f"admission by cache blocks: {max_total_tokens // block_tokens} blocks of "
                f"{block_tokens} tokens; a request reserves ceil((prompt + max_new_tokens) / "
                f"{block_tokens}) blocks and waits in the queue when they are not free (running "
                "requests never run out mid-decode, so none is retracted)"
            )
        if dp_size > 1:  # one policy per DP group (each group's ranks hold its own caches)
            self.policy = DpSchedulePolicy(dp_size, **budget, **order, prefix_cache=radix)
            routing = BALANCE_POLICY if radix is None else PREFIX_POLICY
            logger.info(f"DP attention: {dp_size} groups, requests routed {routing}")
        self.recv_conn, self.send_conn = recv, send
        self.default_generator = make_generator(random_seed, runner.device)
        self.parent_pid = os.getppid()
        self.num_steps = 0
        self.num_generated = 0
        self.last_step_time = 0.0
        self.stopping = False
        self.pending_stats: list[int] = []
        self.pending_flushes: list[FlushCacheResult] = []
        self.outputs: list[ReqOutput] = []
        self.grammar_queue = GrammarQueue(grammar_compiler)
        self.bitmask_buffer = BitmaskBuffer(runner.vocab_size)

    # --- receiving -----------------------------------------------------------------------------

    def _recv_all(self, block: bool) -> list[Any]:
        msgs: list[Any] = []
        timeout = envs.SGLANG_SCHEDULER_IDLE_POLL_S.get() if block else 0.0
        if block and len(self.grammar_queue):  # a grammar is compiling: look again soon
            timeout = _GRAMMAR_POLL_S
        try:
            if self.recv_conn.poll(timeout):
                msgs.append(self.recv_conn.recv())
                while self.recv_conn.poll(0):
                    msgs.append(self.recv_conn.recv())
        except (EOFError, OSError):
            logger.info("the tokenizer manager went away; shutting down")
            self.stopping = True
        if block and not msgs and os.getppid() != self.parent_pid:
            logger.info("the launching process exited; shutting down")
            self.stopping = True
        return msgs

    def _handle(self, msg: Any) -> None:
        try:
            self._handle_one(msg)
        except Exception as exc:  # one bad message must not take the scheduler down
            logger.exception(f"scheduler failed to handle {type(msg).__name__}")
            rid = getattr(msg, "rid", None)
            if isinstance(msg, TokenizedGenerateReq) and rid is not None:
                self.policy.remove(rid)
                self._fail_rid(rid, f"internal error while admitting the request: {exc!r}")

    def _handle_one(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            req = self.policy.remove(msg.rid) or self.grammar_queue.remove(msg.rid)
            if req is not None:
                req.finish = FinishReason("abort", message="aborted")
                self.outputs.append(self._output(req, [], [], []))
        elif isinstance(msg, StatsReq):
            self.pending_stats.append(msg.req_id)
        elif isinstance(msg, FlushCacheReq):
            self.pending_flushes.append(self._flush_cache(msg.req_id))
        elif isinstance(msg, ShutdownReq):
            self.stopping = True
        else:
            logger.warning(f"scheduler ignores an unknown message {type(msg).__name__}")

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        n = len(msg.input_ids)
        if n == 0 or n >= self.context_length:
            self._reject(
                msg.rid,
                f"prompt of {n} tokens does not fit the context length {self.context_length}",
            )
            return
        if any(t < 0 or t >= self.runner.vocab_size for t in msg.input_ids):
            self._reject(msg.rid, f"input_ids must be in [0, {self.runner.vocab_size})")
            return
        room = self.context_length - n
        wanted = msg.sampling_params.max_new_tokens
        req = Req.from_message(msg, room if wanted is None else min(wanted, room))
        if not self.policy.can_ever_fit(req):
            self._reject(
                msg.rid,
                f"request needs {req.reserved_tokens} tokens (prompt {n} + max_new_tokens "
                f"{req.max_new_tokens}) but --max-total-tokens {self.policy.max_total_tokens} "
                f"allows {self.policy.request_limit} a request",
            )
            return
        if msg.sampling_params.seed is not None:
            req.generator = make_generator(msg.sampling_params.seed, self.runner.device)
        if req.wants_input_logprobs:
            req.input_logprobs = [None] * n
            if req.top_logprobs_num > 0:
                req.input_top_logprobs = [None] * n
        if msg.grammar is not None:  # admitted once its grammar has compiled (off this loop)
            why = self.grammar_queue.add(req, msg.grammar)
            if why is not None:
                self._reject(msg.rid, why)
            return
        self.policy.add(req)

    def _flush_cache(self, req_id: int) -> FlushCacheResult:
        """Drop every cached prefix; the ranks let go of the blocks with the next plan (sent at
        once, before the answer)."""
        trees = self._prefix_caches()
        if not trees:
            return FlushCacheResult(req_id, True, "no prefix cache to flush")
        busy = len(self.policy.running) + len(self.policy.waiting)
        if busy:
            return FlushCacheResult(
                req_id, False, f"cache not flushed: {busy} requests are running or waiting"
            )
        freed = sum(tree.flush() for tree in trees)
        return FlushCacheResult(req_id, True, f"flushed {freed} cached blocks")

    def _prefix_caches(self) -> list[RadixCache]:
        policy = self.policy
        if isinstance(policy, DpSchedulePolicy):
            return policy.prefix_caches
        return [] if policy.prefix_cache is None else [policy.prefix_cache]

    def _admit_compiled(self) -> None:
        ready, failed = self.grammar_queue.poll()
        for req in ready:
            self.policy.add(req)
        for req, message, status in failed:
            self.send_conn.send(ReqError(req.rid, message, status))

    def _reject(self, rid: str, message: str) -> None:
        self.send_conn.send(ReqError(rid, message, 400))

    def _fail_rid(self, rid: str, message: str) -> None:
        """The server failed this request (a 500 for it alone)."""
        self.send_conn.send(ReqError(rid, message, 500))

    def _fail(self, req: Req, message: str) -> None:
        """Fail one running request: free its reservation and cache, tell the client why."""
        if req.finish is None:
            req.finish = FinishReason("abort", message=message)
            if req in self.policy.running:
                self.policy.release(req)
        self._fail_rid(req.rid, message)

    # --- one step ------------------------------------------------------------------------------

    def _broadcast(self, plan: ForwardPlan) -> None:
        if self.tp_group.world_size > 1:
            try:
                self.tp_group.broadcast_object(plan, src=0)
            except RuntimeError as exc:  # gloo names the peer that went away
                raise _lost_peer("rank 0", exc) from exc

    def _run_step(self, step: Step) -> None:
        self._broadcast(step.plan)
        started = time.perf_counter()
        try:
            logits = self.runner.execute(step.plan)
            if logits is not None and logits.shape[0] != len(step.plan.output_rows):
                raise RuntimeError(
                    f"the forward returned {logits.shape[0]} logit rows, the plan asked for "
                    f"{len(step.plan.output_rows)}"
                )
        except Exception as exc:  # a failed forward must not take the server down
            lost = _lost_peer("rank 0", exc) if is_transport_failure(exc) else None
            if lost is None:
                logger.exception("forward failed; aborting the requests of this batch")
            why = str(lost) if lost is not None else f"internal error: {exc}"
            for row in step.rows:
                if row.req.finish is None:
                    row.req.finish = FinishReason("abort", message=why)
                    self.policy.release(row.req)
                    self.outputs.append(self._output(row.req, [], [], []))
            if lost is not None:  # a collective inside the forward: the engine cannot go on
                self._flush()
                raise lost from exc
            return
        self.num_steps += 1
        generated = self.num_generated
        # The tree takes what this step left in the caches before finished requests let go.
        self.policy.cache_step(step.rows)
        if logits is not None:
            self._process_logits(step, logits)
        self.last_step_time = time.perf_counter() - started
        plan = step.plan
        lens = plan.seq_lens or tuple(n for sub in plan.dp_plans for n in sub.seq_lens)
        if self.step_log.record(lens, self.last_step_time, self.num_generated - generated):
            policy = self.policy
            usage = policy.reserved / max(1, policy.max_total_tokens)
            line = self.step_log.line(
                running=len(policy.running), queued=len(policy.waiting), token_usage=usage
            )
            trees = self._prefix_caches()
            if trees:
                line += "; " + self.step_log.prefix_cache_text(
                    prompt_tokens=policy.prompt_tokens,
                    cached_tokens=policy.cached_tokens,
                    evicted_blocks=sum(t.evicted_blocks for t in trees),
                    cache_usage=policy.cached_cache_tokens / max(1, policy.max_total_tokens),
                )
            logger.info(line)

    def _process_logits(self, step: Step, logits: torch.Tensor) -> None:
        """``logits`` holds the plan's ``output_rows`` only (the sampled and log-prob rows)."""
        where = {row: i for i, row in enumerate(step.plan.output_rows)}
        failed: set[str] = set()
        for row in step.rows:
            if row.req.input_logprobs is not None:
                try:
                    self._record_input_logprobs(row, logits, where)
                except Exception as exc:  # this request fails; the batch goes on
                    logger.exception(f"input log-probs failed for request {row.req.rid}")
                    self._fail(row.req, f"internal error computing prompt log-probs: {exc!r}")
                    failed.add(row.req.rid)
        sampled = [row for row in step.rows if row.sample and row.req.rid not in failed]
        done_without_sampling = [
            row.req
            for row in step.rows
            if not row.sample and row.req.prompt_done and row.req.rid not in failed
        ]
        for req in done_without_sampling:  # max_new_tokens == 0
            req.finish = FinishReason("length", message=None)
            self.policy.release(req)
            self.outputs.append(self._output(req, [], [], []))
        if not sampled:
            return
        # The policy's logit row of each sampled request (in step order), then its returned row.
        plan_row = dict(
            zip([r.req.rid for r in step.rows if r.sample], step.plan.sample_rows, strict=True)
        )
        rows_idx = [where[plan_row[r.req.rid]] for r in sampled]
        if rows_idx == list(range(logits.shape[0])):  # a plain decode step: every row, in order
            batch_logits = logits
        else:
            batch_logits = logits.index_select(0, torch.tensor(rows_idx, device=logits.device))
        sampling_rows = [
            SamplingRow(
                params=r.req.params,
                prompt_ids=r.req.input_ids,
                output_ids=r.req.output_ids,
                generator=r.req.generator,
                return_logprob=r.req.return_logprob,
                top_logprobs_num=r.req.top_logprobs_num,
            )
            for r in sampled
        ]
        bitmask, forced = step_constraints(
            [r.req for r in sampled], self.bitmask_buffer, self.grammar_queue.compiler
        )
        for srow, token in zip(sampling_rows, forced):
            srow.forced_token = token
        try:
            out = sample(batch_logits, sampling_rows, self.default_generator, bitmask)
        except Exception:
            logger.exception("sampling failed for a batch; retrying its rows one at a time")
            out, sampled = self._sample_alone(sampled, batch_logits, sampling_rows, bitmask)
        for i, row in enumerate(sampled):
            req, token = row.req, out.token_ids[i]
            why = advance(req, token)
            if why is not None:
                self._fail(req, f"internal error: {why}")
                continue
            req.output_ids.append(token)
            self.num_generated += 1
            req.finish = self._check_finish(req, token)
            if req.finish is None and req.grammar is not None and req.grammar.terminated:
                req.finish = FinishReason("stop", matched=token)
            if req.finish is not None:
                self.policy.release(req)
            self.outputs.append(
                self._output(req, [token], [out.logprobs[i]], [out.top_logprobs[i]])
            )

    def _sample_alone(
        self,
        rows: list[StepRow],
        logits: torch.Tensor,
        sampling_rows: list[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> tuple[SampleOutput, list[StepRow]]:
        """Sample each row by itself; a row that still fails fails its request alone."""
        kept: list[StepRow] = []
        merged = SampleOutput([], [], [])
        for i, (row, srow) in enumerate(zip(rows, sampling_rows)):
            try:
                mask = None if bitmask is None else bitmask[i : i + 1]
                one = sample(logits[i : i + 1], [srow], self.default_generator, mask)
            except Exception as exc:
                logger.exception(f"sampling failed for request {row.req.rid}")
                self._fail(row.req, f"internal error while sampling: {exc!r}")
                continue
            kept.append(row)
            merged.token_ids += one.token_ids
            merged.logprobs += one.logprobs
            merged.top_logprobs += one.top_logprobs
        return merged, kept

    def _record_input_logprobs(
        self, row: StepRow, logits: torch.Tensor, where: dict[int, int]
    ) -> None:
        """Row ``start + j`` of a prefill chunk predicts prompt token ``prompt_pos + j + 1``;
        ``where`` maps a batch row to its row of ``logits``."""
        req = row.req
        assert req.input_logprobs is not None
        wanted = row.logprob_rows
        if not wanted:
            return  # a decode row, or none of the chunk's tokens is returned
        first = wanted.start - row.start + row.prompt_pos  # the position row wanted[0] sits at
        targets = torch.tensor(
            req.input_ids[first + 1 : first + 1 + len(wanted)], device=logits.device
        )
        at = where[wanted.start]  # the plan returns a request's rows contiguously and in order
        if where[wanted[-1]] != at + len(wanted) - 1:
            raise RuntimeError(f"the prompt rows of {req.rid} are not contiguous in the logits")
        rows = logits[at : at + len(wanted)].float()
        all_lp = torch.log_softmax(rows, dim=-1)
        lp = all_lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        for j, value in enumerate(lp):
            req.input_logprobs[first + 1 + j] = float(value)
        if req.input_top_logprobs is not None:  # echo with logprobs: the prompt's top-k too
            vals, idx = all_lp.topk(min(req.top_logprobs_num, all_lp.shape[-1]), dim=-1)
            for j, (v, t) in enumerate(zip(vals.tolist(), idx.tolist())):
                req.input_top_logprobs[first + 1 + j] = list(zip(t, v))

    def _check_finish(self, req: Req, token: int) -> FinishReason | None:
        p = req.params
        if token in p.stop_token_ids:
            return FinishReason("stop", matched=token)
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason("stop", matched=token)
        if len(req.output_ids) >= req.max_new_tokens:
            return FinishReason("length")
        if req.prompt_len + len(req.output_ids) >= self.context_length:
            return FinishReason("length")
        return None

    def _output(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[float | None],
        tops: list[list[tuple[int, float]] | None],
    ) -> ReqOutput:
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=tokens,
            new_logprobs=logprobs if req.return_logprob else [],
            new_top_logprobs=tops if req.return_logprob and req.top_logprobs_num else [],
            finish=req.finish,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        if req.input_logprobs is not None and not req.input_logprobs_sent and req.prompt_done:
            out.input_logprobs = req.input_logprobs[req.logprob_start_len :]
            if req.input_top_logprobs is not None:
                out.input_top_logprobs = req.input_top_logprobs[req.logprob_start_len :]
            req.input_logprobs_sent = True
        return out

    # --- loop ----------------------------------------------------------------------------------

    def _stats(self, req_id: int) -> SchedulerStats:
        trees = self._prefix_caches()
        blocks = self.runner.block_pool()
        return SchedulerStats(
            prompt_tokens=self.policy.prompt_tokens,
            cached_tokens=self.policy.cached_tokens,
            cache_tokens=self.policy.cached_cache_tokens,
            evicted_blocks=sum(t.evicted_blocks for t in trees),
            evicted_snapshots=sum(t.evicted_snapshots for t in trees),
            state_snapshots=sum(t.num_snapshots for t in trees),
            free_blocks=-1 if blocks is None else blocks.num_free,
            total_blocks=-1 if blocks is None else blocks.num_blocks,
            req_id=req_id,
            num_running_reqs=len(self.policy.running),
            num_waiting_reqs=len(self.policy.waiting) + len(self.grammar_queue),
            num_active_caches=len(self.runner.caches),
            reserved_tokens=self.policy.reserved,
            max_total_tokens=self.policy.max_total_tokens,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated,
            last_step_time_s=self.last_step_time,
        )

    def _flush(self) -> None:
        if self.outputs:
            self.send_conn.send(BatchOutput(self.outputs))
            self.outputs = []
        for req_id in self.pending_stats:
            self.send_conn.send(self._stats(req_id))
        self.pending_stats = []
        for result in self.pending_flushes:  # after the plan that let go of the blocks
            self.send_conn.send(result)
        self.pending_flushes = []

    def run(self) -> None:
        last_broadcast = time.monotonic()
        lost = False
        try:
            while not self.stopping:
                for msg in self._recv_all(block=not self.policy.has_work()):
                    self._handle(msg)
                if self.stopping:
                    break
                if len(self.grammar_queue):
                    self._admit_compiled()
                step = self.policy.next_step()
                if not step.plan.is_noop:
                    self._run_step(step)
                    last_broadcast = time.monotonic()
                elif (
                    self.tp_group.world_size > 1
                    and time.monotonic() - last_broadcast > self.heartbeat_s
                ):
                    self._broadcast(ForwardPlan())
                    last_broadcast = time.monotonic()
                self._flush()
        except (BrokenPipeError, EOFError):
            logger.info("the tokenizer manager went away; shutting down")
        except LostPeerError as exc:
            logger.error(f"{exc}; failing every request and exiting")
            try:  # the front end fails the requests with this reason, not just an exit code
                self.send_conn.send(SchedulerFailed(str(exc)))
            except (OSError, ValueError):
                pass
            lost = True
            raise
        finally:
            if self.grammar_queue.compiler is not None:
                self.grammar_queue.compiler.shutdown()
            if not lost:  # after a lost peer this broadcast would only fail again
                self._broadcast(ForwardPlan(shutdown=True))


def run_follower(runner: ModelRunner, tp_group: Any) -> None:
    """Ranks > 0: apply every plan rank 0 broadcasts until it says shut down. A rank 0 that went
    away (its node died) fails the broadcast at once, a silent one within the group's timeout
    (rank 0 sends a heartbeat well inside it); a launcher that went away ends this rank too."""
    parent = os.getppid()
    while True:
        try:
            plan: ForwardPlan = tp_group.broadcast_object(None, src=0)
        except RuntimeError as exc:
            raise _lost_peer(f"rank {tp_group.rank}", exc) from exc
        if plan.shutdown:
            return
        if os.getppid() != parent:
            logger.error(f"rank {tp_group.rank}: its launcher exited; stopping")
            return
        try:
            runner.execute(plan)
        except Exception:  # rank 0 sees the same failure and aborts the batch's requests
            logger.exception("forward failed on a follower rank")
