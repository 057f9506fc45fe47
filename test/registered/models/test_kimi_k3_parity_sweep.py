"""Kimi K3 greedy parity sweep, the CPU subset (``sglang.test.kimi_k3_parity`` describes a case;
the wide sweep is ``scripts/kimi_k3_parity_sweep.py``, counts in docs/parity.md): random tiny K3
models against the cache-free reference (transformers' Kimi Linear KDA, the K3 description's
AttnRes, NoPE MLA and latent MoE), prompts at the 64-token KDA chunk boundaries, chunked prefill
with the conv state carried across forwards, then batched greedy decode through the recurrent KDA
step. Every prefill row and greedy step must be the reference argmax (or within a 1e-3 margin: a
counted near-tie) and every logit within 1e-3 of the largest |logit|."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_parity import REL_TOL, KimiCase, random_kimi_case, run_kimi_case
from sglang.test.kimi_k3_tiny import CONFIG_A
from sglang.test.run import run_this_file

register_cpu_ci(est_time=60)


def _check(case: KimiCase) -> None:
    r = run_kimi_case(case)
    print(
        f"{case.label} lengths {case.prompt_lens}: max err {r.max_err:.1e}, near-ties {r.near_ties}"
    )
    assert r.ok, f"{case.label} lengths {case.prompt_lens}: diverged at {r.first_divergence}"
    assert r.max_err <= REL_TOL * r.max_ref, (case.label, r.max_err, r.max_ref)


@pytest.mark.parametrize("seed", range(4))
def test_random_k3_greedy_matches_reference(seed: int) -> None:
    _check(random_kimi_case(seed, max_len=70, num_prompts=2, new_tokens=3))


def test_kda_chunk_and_conv_state_boundaries() -> None:
    """K3's shape (config A): prompts ending on either side of the 64-token chunk, prefilled in
    2-token forwards (shorter than the conv kernel's 3-row state), then decoded."""
    _check(KimiCase(11, CONFIG_A, (63, 65), 4, 2))


def test_planted_conv_state_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.layers.attention import kda

    real = kda.causal_conv_prefill  # carried rows in the wrong order: a plausible state bug
    monkeypatch.setattr(kda, "causal_conv_prefill", lambda x, w, state: real(x, w, state.flip(0)))
    r = run_kimi_case(KimiCase(12, CONFIG_A, (9,), 3, 2))
    assert not r.ok or r.max_err > 1e-2


if __name__ == "__main__":
    run_this_file(__file__)
