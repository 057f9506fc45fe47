"""DeepSeek V4's sparse prefill attention kernel on a GPU (skipped elsewhere) against the torch
path it replaces, at the bench model's width (64 heads of 512, window 128, indexer top-512).

- Kernel vs ``dsv4_attention`` on random bf16 keys: the ratio-4 layer's picks from the first
  position (fewer visible entries than k for most queries) and in a later chunk, the ratio-128
  layer (every complete block), window only, 8 heads of 64 (a padded head tile) and an fp32
  query. With three-part probabilities both sides are fp32 maths over exact products (bf16
  keys), so only the summation order (and the exp rounding) differs: bound 1e-5 on the worst
  query; the default two parts (16 bits of each probability): 2e-5.
- The indexer's kernel-scored picks (``LightningIndexer.pick`` on CUDA: Triton scores, the same
  stable sort) against the torch ``select`` at the bench width (64 heads of 128, top-512, 4096
  entries): the same entries on nearly every query; where a query's choice differs, the entries
  swapped are a near-tie in the torch scores (within 1e-5 of the largest score: the summation
  order decides them), and queries with fewer visible entries than k agree exactly.
- The default model (bf16) prefilled in two chunks past the ratio-128 block (and a fresh
  request in the same batch): every layer's attention output with the kernel, on the layer
  inputs the torch path saw, against the torch path's (the default two parts: 2e-5).
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file
from sglang.test.sparse_prefill_cases import (
    PrefillCase,
    kernel_path,
    make_inputs,
    max_row_err,
    model_layer_errors,
    scoring_indexer,
    torch_path,
)

register_cuda_ci(est_time=40, suite="h200-1gpu")

pytestmark = pytest.mark.gpu
TOL = 1e-5  # three-part probabilities
TOL_DEFAULT = 2e-5  # the default two parts

WIDE = {"heads": 64, "dim": 512, "window": 128}
CASES = [
    PrefillCase(n=2048, ratio=4, q_first=0, topk=512, **WIDE),
    PrefillCase(n=1024, ratio=4, q_first=3000, topk=512, **WIDE),
    PrefillCase(n=2048, ratio=128, q_first=1000, **WIDE),
    PrefillCase(n=1024, ratio=0, q_first=500, extra_rows=7, **WIDE),
    PrefillCase(n=700, heads=8, dim=64, window=128, ratio=4, q_first=77, topk=64),
    PrefillCase(n=300, ratio=4, q_first=900, topk=512, fp32_q=True, **WIDE),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c.n}-h{c.heads}-r{c.ratio}-q{c.q_first}")
def test_kernel_matches_torch_path(case: PrefillCase) -> None:
    g = torch.Generator("cuda").manual_seed(case.n + case.q_first)
    x = make_inputs(case, "cuda", g)
    ref = torch_path(x)
    out = kernel_path(x, pv_parts=3)
    assert torch.isfinite(out).all()
    err = max_row_err(out, ref)
    default = max_row_err(kernel_path(x), ref)
    print(f"{case}: worst row {err:.2e}, default (two parts) {default:.2e}")
    assert err < TOL and default < TOL_DEFAULT, (err, default)


def test_indexer_kernel_picks_match_torch_select() -> None:

    heads, dim, topk, ratio = 64, 128, 512, 4
    indexer = scoring_indexer(heads, dim, ratio, topk, torch.bfloat16, "cuda")
    g = torch.Generator("cuda").manual_seed(9)
    n, num = 6000, 4096  # positions 10384 .. 16383: every query sees more than k entries
    q_first = num * ratio - n
    q = torch.randn(n, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g, device="cuda") * heads**-0.5
    keys = torch.randn(num, dim, generator=g, device="cuda").to(torch.bfloat16)
    pos = torch.arange(q_first, q_first + n, device="cuda")
    mask = indexer.select(q, w, keys, pos)
    picks = indexer.pick(q, w, keys, pos)
    count = torch.clamp((pos + 1) // ratio, max=topk)
    chosen = torch.zeros_like(mask)
    chosen.scatter_(1, picks, torch.arange(topk, device="cuda")[None, :] < count[:, None])
    differ = torch.nonzero((chosen != mask).any(dim=1)).flatten()
    print(f"queries whose picks differ: {differ.numel()} of {n}")
    assert differ.numel() <= n // 100
    for i in differ.tolist():
        dots = (q[i].float() @ keys.float().t()).relu() * dim**-0.5
        scores = (dots * w[i, :, None]).sum(dim=0)
        kth = scores[mask[i]].min()  # the torch choice's k-th score
        swapped = scores[chosen[i] & ~mask[i]]
        assert float((kth - swapped).max()) <= 1e-5 * float(scores.abs().max()), i
    # fewer visible entries than k (positions 0 .. 699): every visible one is picked
    short = torch.arange(700, device="cuda")
    few = indexer.pick(q[:700], w[:700], keys, short)
    visible = (short + 1) // ratio
    j = torch.arange(topk, device="cuda")[None, :].expand(700, topk)
    live = j < visible[:, None]
    first = torch.where(live, few, num).sort(dim=1).values  # the first `visible` picks, sorted
    assert torch.equal(first, torch.where(live, j, num))


def test_model_layers_match_torch_path() -> None:
    errors = model_layer_errors("cuda", first=200, second=150, fresh=60)
    print("per layer call, worst row:", " ".join(f"{e:.2e}" for e in errors))
    assert max(errors) < TOL_DEFAULT, errors


if __name__ == "__main__":
    run_this_file(__file__)
