"""The scheduler over the built-in model with logits pruned to the rows a step reads (the plan's
``logit_rows``) gives what it gave when every forward returned every row's logits: the same
tokens (greedy and seeded sampling), output log-probs and top log-probs, and prompt log-probs
(echo, with top-k, from position 0 and from ``logprob_start_len``, a prompt-only request with
``max_new_tokens=0``), under chunked prefill, on the per-request and the static-decode (slot pool)
runner. The full-logits path is the runner run with ``logit_rows=None`` and the rows picked
afterwards, i.e. the behaviour before pruning. With ``--max-logit-rows-per-step`` at its least
(``--max-running-requests``) no step computes more rows, the echo prompts' chunks are shortened,
and the outputs are still the uncapped run's. Also: the static decode's one row per request is
pruned too when a decode-sized step samples only some rows."""

from __future__ import annotations

import dataclasses
from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang.srt.managers.io_struct import ReqOutput, TokenizedGenerateReq
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.cpu_model_runner import default_model_runner
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

CHUNK = 8
TOL = 1e-5  # fp32 rounding of the LM head over fewer rows (measured <= 1e-6 on these logits)


class _FullLogits:
    """The runner as it was before pruning: every row's logits, then the plan's rows picked."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device, self.vocab_size, self.caches = runner.device, runner.vocab_size, runner.caches

    def execute(self, plan: ForwardPlan) -> torch.Tensor | None:
        full = self.runner.execute(dataclasses.replace(plan, logit_rows=None))
        return None if full is None else full[list(plan.output_rows)]


class _Counting:
    """The pruned runner, counting the rows it computes logits for and the rows it runs, the most
    logit rows of one step, and the forwards."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device, self.vocab_size, self.caches = runner.device, runner.vocab_size, runner.caches
        self.logit_rows = self.tokens = self.most = self.steps = 0

    def execute(self, plan: ForwardPlan) -> torch.Tensor | None:
        out = self.runner.execute(plan)
        if out is not None:
            self.logit_rows += out.shape[0]
            self.tokens += plan.num_tokens
            self.most = max(self.most, out.shape[0])
            self.steps += 1
        return out


def _runner(static: bool) -> tuple[ModelRunner, int]:
    runner, setup = default_model_runner(static)
    assert runner.pooled == static
    return runner, setup.block_tokens


def _requests(vocab: int) -> list[TokenizedGenerateReq]:
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, ignore_eos=True)
    prompt_only = SamplingParams(max_new_tokens=0)
    return [
        TokenizedGenerateReq("echo", ids(20), greedy, True, 3, 0),  # 3 chunks, top-3, from 0
        TokenizedGenerateReq("plain", ids(5), greedy),
        TokenizedGenerateReq("seeded", ids(6), seeded, True, 2),  # output log-probs only
        TokenizedGenerateReq("tail", ids(12), prompt_only, True, 0, 5),  # prompt from 5 on
        TokenizedGenerateReq("short-echo", ids(2), greedy, True, 0, 0),
    ]


def _serve(
    runner: Any, block_tokens: int, max_logit_rows: int | None = None
) -> dict[str, list[ReqOutput]]:
    _, send = Pipe(duplex=False)
    sched = Scheduler(
        runner,
        SimpleNamespace(world_size=1),
        context_length=400,
        eos_token_ids=[],
        max_total_tokens=1200,
        max_running_requests=4,
        chunked_prefill_size=CHUNK,
        random_seed=0,
        recv=None,  # type: ignore[arg-type]  # driven step by step, not through run()
        send=send,
        block_tokens=block_tokens,
        max_logit_rows=max_logit_rows,
    )
    for msg in _requests(runner.vocab_size):
        sched._add_request(msg)
    outs: dict[str, list[ReqOutput]] = {}
    while sched.policy.has_work():
        step = sched.policy.next_step()
        if not step.plan.is_noop:
            sched._run_step(step)
        for out in sched.outputs:
            outs.setdefault(out.rid, []).append(out)
        sched.outputs = []
    return outs


def _flat(outs: list[ReqOutput]) -> dict[str, Any]:
    inputs = [o for o in outs if o.input_logprobs is not None]
    return {
        "tokens": [t for o in outs for t in o.new_token_ids],
        "logprobs": [x for o in outs for x in o.new_logprobs],
        "tops": [x for o in outs for x in o.new_top_logprobs],
        "input": inputs[0].input_logprobs if inputs else None,
        "input_top": inputs[0].input_top_logprobs if inputs else None,
        "finish": outs[-1].finish,
    }


def _close(got: Any, want: Any) -> bool:
    """Equal structure and ints; floats within TOL."""
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= TOL
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    return got == want


def _assert_same(got: dict[str, list[ReqOutput]], want: dict[str, list[ReqOutput]]) -> None:
    assert set(got) == set(want) == {"echo", "plain", "seeded", "tail", "short-echo"}
    for rid, outs in want.items():
        g, w = _flat(got[rid]), _flat(outs)
        assert g["tokens"] == w["tokens"], rid
        for key in ("logprobs", "tops", "input", "input_top"):
            assert _close(g[key], w[key]), (rid, key)
        assert g["finish"] == w["finish"], rid


@pytest.mark.parametrize("static", [False, True], ids=["per-request", "static-decode"])
def test_pruned_logits_serve_what_full_logits_served(static: bool) -> None:
    full_runner, block_tokens = _runner(static)
    want = _serve(_FullLogits(full_runner), block_tokens)
    pruned = _Counting(_runner(static)[0])
    got = _serve(pruned, block_tokens)
    _assert_same(got, want)
    echo, tail = _flat(got["echo"]), _flat(got["tail"])
    assert len(echo["tokens"]) == 4 and len(echo["input"]) == 20 and echo["input"][0] is None
    assert all(len(t) == 3 for t in echo["input_top"][1:])
    assert tail["tokens"] == [] and len(tail["input"]) == 7 and None not in tail["input"]
    # Every prompt row of the echo requests and the tail's from 4 on; else one per sample.
    assert pruned.logit_rows < pruned.tokens
    print(f"logit rows computed: {pruned.logit_rows} of {pruned.tokens} rows run")


def test_logit_row_cap_serves_what_the_uncapped_run_served() -> None:
    """Cap 4 (= max running requests): the 20-token echo's 8-token chunks need 8 prompt rows, so
    they are shortened beside the decodes and its prompt takes more steps; every output, prompt
    log-probs included, is the uncapped run's."""
    runner, block_tokens = _runner(False)
    free = _Counting(runner)
    want = _serve(free, block_tokens)
    capped = _Counting(_runner(False)[0])
    got = _serve(capped, block_tokens, max_logit_rows=4)
    _assert_same(got, want)
    assert free.most > 4 >= capped.most and capped.steps > free.steps
    assert capped.logit_rows == free.logit_rows  # the same rows, spread over more steps
    print(f"logit rows per step at most: {free.most} uncapped, {capped.most} capped")


def test_static_decode_rows_pruned() -> None:
    runner = _runner(True)[0]
    ref = _runner(True)[0]
    ids = tuple(torch.randint(0, runner.vocab_size, (2,)).tolist())
    new = ForwardPlan(("a", "b"), (1, 1), ids, new_rids=("a", "b"))  # all 1-token: static path
    want = ref.execute(new)
    got = runner.execute(dataclasses.replace(new, sample_rows=(1,), logit_rows=(1,)))
    assert want is not None and got is not None and got.shape == (1, runner.vocab_size)
    assert torch.equal(got, want[1:])


if __name__ == "__main__":
    run_this_file(__file__)
