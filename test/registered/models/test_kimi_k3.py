"""Whole-model Kimi K3 on tiny random configs (every parameter random):

- our forward equals an independent, cache-free torch reference written from the design notes
  (AttnRes bank and partial sums, transformers' pure-torch chunked KDA, naive NoPE MLA with the
  output gate, the hand-written latent MoE), so the layer plumbing and the AttnRes order are right;
- prefill logits equal token-by-token decode through our caches, and equal a prefill split into
  chunks;
- a batch of requests of different lengths (prefill chunks and decode rows mixed) equals each
  request alone.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.models.kimi_k3 import KimiK3Batch, KimiK3ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_reference import ATOL, RTOL, reference_logits
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, CONFIG_C, make_model, tokens
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)

CONFIGS = {"A": CONFIG_A, "B": CONFIG_B, "C": CONFIG_C}
# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> dict[str, KimiK3ForCausalLM]:
    return {name: make_model(raw, seed=7) for name, raw in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_independent_reference(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(70, seed=1)  # > one 64-token KDA chunk
    torch.testing.assert_close(
        model(ids, torch.arange(70)), reference_logits(model, ids), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_equals_token_by_token_decode(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(20, seed=2)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    steps = [model.decode(ids[i : i + 1], [cache]) for i in range(20)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=RTOL, atol=ATOL)
    assert len(cache) == 20


@pytest.mark.parametrize("name", ["A", "B"])
def test_chunked_prefill_equals_one_prefill(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(90, seed=3)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    parts = [model.prefill(ids[lo:hi], cache) for lo, hi in ((0, 7), (7, 12), (12, 13), (13, 90))]
    torch.testing.assert_close(torch.cat(parts), full, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["A", "B"])
def test_mixed_batch_equals_each_request_alone(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    prompts = [tokens(n, seed=10 + n) for n in (9, 3, 17, 1)]
    follow = [tokens(n, seed=30 + n) for n in (1, 6, 1, 4)]
    alone = []
    for prompt, nxt in zip(prompts, follow):
        cache = model.new_request_cache()
        model.prefill(prompt, cache)
        alone.append(model.prefill(nxt, cache))
    # batched: all prompts in one forward, then decode rows and prefill chunks in one forward
    caches = [model.new_request_cache() for _ in prompts]
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(p.shape[0]) for p in prompts])
    first = model(ids, pos, KimiK3Batch([p.shape[0] for p in prompts], caches))
    ids2 = torch.cat(follow)
    pos2 = torch.cat(
        [torch.arange(p.shape[0], p.shape[0] + f.shape[0]) for p, f in zip(prompts, follow)]
    )
    second = model(ids2, pos2, KimiK3Batch([f.shape[0] for f in follow], caches))
    torch.testing.assert_close(second, torch.cat(alone), rtol=RTOL, atol=ATOL)
    alone_first = [model.prefill(p, model.new_request_cache()) for p in prompts]
    torch.testing.assert_close(first, torch.cat(alone_first), rtol=RTOL, atol=ATOL)


def test_bf16_prefill_and_decode_agree() -> None:
    # Every expert chosen (top-k = E): with sparse routing, bf16 rounding flips a few tokens'
    # expert choice between the two paths, which is an O(1) change for those tokens.
    dense_routing = {**CONFIG_A, "num_experts": 3, "num_experts_per_token": 3}
    model = make_model(dense_routing, seed=8, dtype=torch.bfloat16)
    ids = tokens(12, seed=4)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    steps = torch.cat([model.decode(ids[i : i + 1], [cache]) for i in range(12)])
    # Measured 3.6%. Random KDA layers amplify a relative input change ~3.5x (fp32, measured), so
    # bf16 rounding compounds over 8 random layers; a wrong state or cache row gives ~100%.
    rel = float((steps - full).norm() / full.norm())
    assert full.dtype == torch.float32 and rel < 0.1, rel


def test_positions_must_continue_the_cache(models: dict[str, KimiK3ForCausalLM]) -> None:
    model = models["A"]
    cache = model.new_request_cache()
    model.prefill(tokens(4, seed=5), cache)
    with pytest.raises(ValueError, match="continue its cache"):
        model(tokens(2, seed=6), torch.tensor([0, 1]), KimiK3Batch([2], [cache]))
    with pytest.raises(ValueError, match="do not sum"):
        model(tokens(2, seed=6), torch.tensor([4, 5]), KimiK3Batch([3], [cache]))


if __name__ == "__main__":
    run_this_file(__file__)
