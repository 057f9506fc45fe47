"""A ``ModelRunner`` on CPU set up to decode as a test server would (eagerly per request, on the
paged slot pool, or on the static decode run without graphs: the exact A/B of a graph replay),
the default tiny model's, and the scheduler's plans served through two runners at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.model_executor.model_runner import DecodeSetup, ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.tolerance import rel_max_err


def cpu_model_runner(
    model_path: str,
    *,
    context_length: int,
    budget: int,
    max_running_requests: int,
    max_total_tokens: int | None = None,
    static_without_graphs: bool = False,
    **server_args: Any,
) -> tuple[ModelRunner, DecodeSetup]:
    """-> (the runner, its decode setup): ``model_path`` on CPU (seed 0; ``max_total_tokens`` and
    ``server_args`` are the server's flags), its decode set up as the scheduler would for requests
    of ``context_length`` tokens in a ``budget`` of tokens."""
    args = ServerArgs(
        model_path=model_path,
        device="cpu",
        random_seed=0,
        max_total_tokens=max_total_tokens,
        **server_args,
    ).resolved()
    runner = ModelRunner(args, 0, 1)
    setup = runner.init_decode(
        context_length=context_length,
        max_total_tokens=budget,
        max_running_requests=max_running_requests,
        static_without_graphs=static_without_graphs,
    )
    return runner, setup


def default_model_runner(static: bool) -> tuple[ModelRunner, DecodeSetup]:
    """The default tiny model: up to 4 running requests of at most 400 tokens in a 1200-token
    budget; ``static``: the static decode."""
    # The static decode preallocates the budget: only where it is a bound (the flag on CPU).
    return cpu_model_runner(
        ensure_default_model(),
        context_length=400,
        budget=1200,
        max_running_requests=4,
        max_total_tokens=1200 if static else None,
        static_without_graphs=static,
    )


@dataclass(frozen=True)
class PairedServing:
    steps: int
    most_running: int  # the most requests the policy ran at once
    worst_rel_err: float  # of the first runner's logits against the second's (rel_max_err)


def serve_on_both(
    policy: SchedulePolicy, runner: ModelRunner, reference: ModelRunner
) -> PairedServing:
    """Drain ``policy``: each step's plan runs on both runners (both return logits or neither);
    the greedy tokens of ``runner``'s sampled rows are the requests' next tokens, and a request
    is released once it has its ``max_new_tokens``."""
    most, worst, steps = 0, 0.0, 0
    while policy.has_work():
        step = policy.next_step()
        got, want = runner.execute(step.plan), reference.execute(step.plan)
        steps += 1
        most = max(most, len(policy.running))
        if got is None or want is None:
            assert got is None and want is None
            continue
        worst = max(worst, rel_max_err(got, want))
        # The runner returns the plan's output_rows only (here: the sampled rows).
        out = step.plan.output_rows
        picks = got[[out.index(r) for r in step.plan.sample_rows]].argmax(dim=-1).tolist()
        for row, token in zip([r for r in step.rows if r.sample], picks):
            row.req.output_ids.append(int(token))
            if len(row.req.output_ids) == row.req.max_new_tokens:
                policy.release(row.req)
    return PairedServing(steps, most, worst)
