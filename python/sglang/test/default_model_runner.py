"""The default tiny model's ``ModelRunner`` on CPU, set up to decode as a test server would: up
to 4 running requests of at most 400 tokens in a 1200-token budget, eagerly per request or on
the static decode (the slot pool, run without graphs: the exact A/B of a graph replay)."""

from __future__ import annotations

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.model_executor.model_runner import DecodeSetup, ModelRunner
from sglang.srt.server_args import ServerArgs


def default_model_runner(static: bool) -> tuple[ModelRunner, DecodeSetup]:
    """-> (the runner, its decode setup); ``static``: the static decode."""
    # The static decode preallocates the budget: only where it is a bound (the flag on CPU).
    total = 1200 if static else None
    args = ServerArgs(
        model_path=ensure_default_model(), device="cpu", random_seed=0, max_total_tokens=total
    ).resolved()
    runner = ModelRunner(args, 0, 1)
    setup = runner.init_decode(
        context_length=400,
        max_total_tokens=1200,
        max_running_requests=4,
        static_without_graphs=static,
    )
    return runner, setup
