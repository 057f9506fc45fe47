"""Tensor parallel over gloo on CPU: two scheduler ranks (rank 0 broadcasts every plan) produce
the same greedy tokens as one, with and without DP attention, and with DP attention plus EP; four
ranks with DP attention over two groups of two (attention TP=2) too; a TP size the model cannot
split fails at startup with the model's reason. Under DP attention each group returns only the
logit rows rank 0 reads, so echo (every prompt row's log-prob, in both groups) must match TP=1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from sglang import Engine
from sglang.srt.managers.launcher import EngineStartupError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=85)

PROMPTS = ["Hello, my name is", "Mountains, rivers, forests", "def main():"]


PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG_IDS = list(range(5, 205))  # a 200-token prompt: chunked over two steps


ECHO = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
ONE = {"max_new_tokens": 1, "temperature": 0}
PromptLogprobs = list[tuple[float | None, int]]


def _echo(engine: Engine) -> list[PromptLogprobs]:
    """Every prompt token's log-prob: PROMPTS together (split over the DP groups), then LONG_IDS
    alone (chunked; prompt only)."""
    long = engine.generate(input_ids=LONG_IDS, sampling_params={"max_new_tokens": 0}, **ECHO)
    outs = [*engine.generate(PROMPTS, ONE, **ECHO), long]
    return [[(lp, tok) for lp, tok, _ in o["meta_info"]["input_token_logprobs"]] for o in outs]


@dataclass(frozen=True)
class Tp1:
    tokens: list[list[int]]  # greedy tokens of PROMPTS
    long_tokens: list[int]  # of LONG_IDS alone
    echo: list[PromptLogprobs]


@pytest.fixture(scope="module")
def tp1_all() -> Tp1:
    with Engine(device="cpu", random_seed=0, log_level="warning", chunked_prefill_size=128) as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, PARAMS)]
        want_long = one.generate(input_ids=LONG_IDS, sampling_params=PARAMS)["output_ids"]
        return Tp1(want, want_long, _echo(one))


@pytest.fixture(scope="module")
def tp1(tp1_all: Tp1) -> tuple[list[list[int]], list[int]]:
    """TP=1's greedy tokens for PROMPTS, and for LONG_IDS alone."""
    return tp1_all.tokens, tp1_all.long_tokens


def _assert_echo_matches(got: list[PromptLogprobs], want: list[PromptLogprobs]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [t for _, t in g] == [t for _, t in w] and g[0][0] is None is w[0][0]
        assert [lp for lp, _ in g[1:]] == pytest.approx([lp for lp, _ in w[1:]], abs=1e-4)


@dataclass(frozen=True)
class Served:
    tokens: list[list[int]]
    long_tokens: list[int]
    info: dict[str, Any]
    echo: list[PromptLogprobs] | None


def _serve(*, echo: bool = False, **flags: Any) -> Served:
    """PROMPTS together, then LONG_IDS alone (chunked; under DP the other group idles), on an
    Engine with ``flags``; the prompt log-probs too when ``echo``."""
    with Engine(
        device="cpu", random_seed=0, log_level="warning", chunked_prefill_size=128, **flags
    ) as engine:
        got = [r["output_ids"] for r in engine.generate(PROMPTS, PARAMS)]
        got_long = engine.generate(input_ids=LONG_IDS, sampling_params=PARAMS)["output_ids"]
        return Served(got, got_long, engine.get_server_info(), _echo(engine) if echo else None)


def test_tp2_matches_tp1(tp1: tuple[list[list[int]], list[int]]) -> None:
    two = _serve(tp_size=2)
    assert (two.tokens, two.long_tokens) == tp1
    assert two.info["server_args"]["tp_size"] == 2
    assert two.info["scheduler"]["num_active_caches"] == 0


def test_dp_attention_matches_tp1(tp1_all: Tp1) -> None:
    """TP=2 with DP attention over 2 groups (attention TP=1, the MoE over both ranks, tokens
    gathered around it): three prompts split 2 + 1 over the groups (uneven lengths), then the
    long prompt alone (the other group idle, its steps run empty); and the prompt log-probs of
    the same (each group returns its own rows' logits)."""
    dp = _serve(tp_size=2, dp_size=2, enable_dp_attention=True, echo=True)
    assert (dp.tokens, dp.long_tokens) == (tp1_all.tokens, tp1_all.long_tokens)
    assert dp.echo is not None
    _assert_echo_matches(dp.echo, tp1_all.echo)


def test_dp_attention_tp2_matches_tp1(tp1: tuple[list[list[int]], list[int]]) -> None:
    """TP=4 with DP attention over 2 groups of 2 ranks (attention TP=2: heads split and
    all-reduced within each group, the MoE over all four ranks): uneven groups, then the long
    prompt with the other group idle."""
    dp = _serve(tp_size=4, dp_size=2, enable_dp_attention=True)
    assert (dp.tokens, dp.long_tokens) == tp1
    args = dp.info["server_args"]
    assert (args["tp_size"], args["dp_size"], args["enable_dp_attention"]) == (4, 2, True)


def test_dp_attention_with_ep_matches_tp1(tp1: tuple[list[list[int]], list[int]]) -> None:
    """DP=2 + EP=2: DP attention as above, and the experts expert-parallel over both ranks
    (``--ep-size 2``: whole experts a rank, the gathered rows dispatched by all-to-all), again
    with uneven groups and then an idle group."""
    dp = _serve(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2)
    assert (dp.tokens, dp.long_tokens) == tp1
    args = dp.info["server_args"]
    assert (args["moe_a2a_backend"], args["ep_size"], args["dp_size"]) == ("ep", 2, 2)


def test_unsplittable_tp_fails_at_startup() -> None:
    with pytest.raises(EngineStartupError, match="over 3 ranks"):
        Engine(device="cpu", tp_size=3, log_level="error")


if __name__ == "__main__":
    run_this_file(__file__)
