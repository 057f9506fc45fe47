"""Sampling parameters (validation) and the sampler: greedy, top-k/top-p/min-p filtering, seeded
draws independent of the batch, penalties, log-probs of the model's distribution."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.sampling.penalties import apply_penalties_
from sglang.srt.sampling.sampler import SamplingRow, make_generator, sample
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _row(**params: object) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(params), prompt_ids=[1, 2], output_ids=[])


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_new_tokens": "ten"}, "max_new_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"bogus": 1}, "bogus"),
        ({"n": 0}, "n"),
        ({"n": 10**6}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": 1e9}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2**70}, "top_k"),
        ({"max_new_tokens": 2**64}, "max_new_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["x" * 2000]}, "stop"),
        ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_invalid_params(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict(raw)
    assert needle in str(info.value)


def test_param_normalisation() -> None:
    p = SamplingParams.from_dict({"stop": "x", "top_k": 0, "temperature": None})
    assert p.stop == ("x",) and p.top_k == -1 and p.temperature == 1.0
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens is None
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy


def test_greedy_and_logprobs() -> None:
    logits = _logits(3)
    rows = [_row(temperature=0), _row(top_k=1), _row(temperature=0)]
    for r in rows:
        r.return_logprob, r.top_logprobs_num = True, 3
    out = sample(logits, rows, None)
    assert out.token_ids == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(lp[i, t]))
        top = out.top_logprobs[i]
        assert top is not None and top[0][0] == t and len(top) == 3


def test_filters_that_leave_one_token_act_greedy() -> None:
    logits = _logits(3, seed=1)
    rows = [_row(top_p=1e-6), _row(min_p=1.0), _row(top_k=1, temperature=5.0)]
    gen = make_generator(0, torch.device("cpu"))
    for _ in range(5):
        assert sample(logits, rows, gen).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = _logits(1, seed=2)
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = make_generator(1, torch.device("cpu"))
    seen = {sample(logits, [_row(top_k=3, temperature=2.0)], gen).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_sampling_matches_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = make_generator(7, torch.device("cpu"))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [_row()], gen).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits[0], 0), atol=0.03)


def test_seeded_rows_independent_of_batch() -> None:
    logits = _logits(4, seed=3)
    alone = []
    for _ in range(2):
        row = _row(seed=42, temperature=1.5)
        row.generator = make_generator(42, torch.device("cpu"))
        alone.append(sample(logits[2:3], [row], None).token_ids[0])
    seeded = _row(seed=42, temperature=1.5)
    seeded.generator = make_generator(42, torch.device("cpu"))
    mixed = sample(
        logits,
        [_row(), _row(temperature=0), seeded, _row()],
        make_generator(9, torch.device("cpu")),
    )
    assert alone[0] == alone[1] == mixed.token_ids[2]


def test_penalties() -> None:
    base = torch.tensor([2.0, -2.0, 1.0, 0.5])
    x = base.clone()
    apply_penalties_(x, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert x.tolist() == [1.0, -4.0, 1.0, 0.5]
    x = base.clone()
    apply_penalties_(x, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [2], [3, 3])
    assert x.tolist() == pytest.approx([2.0, -2.0, 1.0, 0.5 - 1.0 - 0.25])


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.5), [0], [1])
    assert sample(logits, [row], None).token_ids == [2]


if __name__ == "__main__":
    run_this_file(__file__)
