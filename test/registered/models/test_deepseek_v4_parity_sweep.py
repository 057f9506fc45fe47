"""DeepSeek V4 greedy parity sweep against transformers, the CPU subset (the wide sweep is
``scripts/dsv4_parity_sweep.py``; docs/parity.md has its counts and findings).

Each case: a random tiny model (every parameter random; seeds walk through every 1-3 layer mix of
sliding / CSA / HCA layers, hash and routed MoE layers random, windows below and above both
blocks, indexer top-k below, around and above the entry count, 1-8 indexer heads so exact
index-score ties occur), prompts cut from one random sequence at the block, window and top-k
boundaries, chunked prefill of all prompts per forward, then batched greedy decode through the
per-request caches or the slot pool's static decode (padded like a graph batch). fp32: every
prefill row and every greedy step must match the reference argmax (a smaller margin than 1e-4
is a counted near-tie) and every logit within 1e-4 of the largest |logit|.

The harness must be able to fail: with transformers' own ``torch.topk`` tie order it reports the
reported divergence (window 16, top-k 5, two indexer heads), and a planted off-by-one in our
compressor's RoPE position is caught.
"""

from __future__ import annotations

import pytest

from sglang.srt.layers.attention import dsv4_compressor
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_parity import (
    ALL_MIXES,
    TIE_CASE_CONFIG,
    TIE_CASE_LENGTHS,
    TIE_CASE_SEED,
    DecodePath,
    SweepCase,
    random_case,
    run_case,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

REL_TOL = 1e-4
# Every 1-3 layer mix (and one random mix) on each path, with other random structures per path.
SEEDS = range(len(ALL_MIXES) + 1)


def _check(case: SweepCase) -> None:
    r = run_case(case)
    print(
        f"{case.label} lengths {case.prompt_lens}: max err {r.max_err:.1e}, near-ties "
        f"{r.near_ties}, tied top-k rows {r.tie_breaks}"
    )
    assert r.ok, f"{case.label} lengths {case.prompt_lens}: diverged at {r.first_divergence}"
    assert r.max_err <= REL_TOL * r.max_ref, (case.label, r.max_err, r.max_ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_eager_greedy_matches_transformers(seed: int) -> None:
    _check(random_case(seed, max_len=300, num_prompts=3, new_tokens=6, path="eager"))


@pytest.mark.parametrize("seed", SEEDS)
def test_slot_pool_static_decode_matches_transformers(seed: int) -> None:
    mix = ALL_MIXES[seed] if seed < len(ALL_MIXES) else None
    _check(
        random_case(
            seed + 1000, max_len=300, num_prompts=3, new_tokens=6, path="pooled", ratios=mix
        )
    )


def _tie_case(chunk: int | None, path: DecodePath) -> SweepCase:
    return SweepCase(TIE_CASE_SEED, TIE_CASE_CONFIG, TIE_CASE_LENGTHS, 3, chunk, path)


def test_reported_lengths_and_config() -> None:
    for chunk, path in ((None, "eager"), (16, "pooled")):
        _check(_tie_case(chunk, path))  # type: ignore[arg-type]


def test_transformers_tie_order_is_what_diverged() -> None:
    r = run_case(_tie_case(None, "eager"), tie_rule=False)
    print(
        f"torch.topk tie order: first divergence (prompt length, row) {r.first_divergence}, "
        f"tied rows {r.tie_breaks}, max err {r.max_err:.2f}"
    )
    assert r.tie_breaks > 0 and not r.ok, "torch.topk's tie order should differ from ours here"


def test_harness_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    real = dsv4_compressor.KVCompressor.emit

    def shifted(self, cand_kv, cand_score, blocks, rotary):  # type: ignore[no-untyped-def]
        return real(self, cand_kv, cand_score, blocks + 1, rotary)  # RoPE one block late

    monkeypatch.setattr(dsv4_compressor.KVCompressor, "emit", shifted)
    r = run_case(SweepCase(3, TIE_CASE_CONFIG, (40, 130), 3, None, "eager"))
    assert r.max_err > 1e-2 and not r.ok


if __name__ == "__main__":
    run_this_file(__file__)
