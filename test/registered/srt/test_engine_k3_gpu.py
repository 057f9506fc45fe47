"""Kimi K3 served on CUDA (run on the H200; skipped elsewhere): a tiny random K3 checkpoint on disk
in the release layout (the test kit's writer; CONFIG_A's shape with rope 16, the absorbed MLA
kernel's widths; fp32, triton MoE runner), served by the Engine with token ids. With
``SGLANG_K3_STATIC_DECODE`` on (the default) decode takes the slot pool and CUDA graphs without
``--max-total-tokens`` (K3's memory model bounds it), and the greedy tokens of graph replay equal
those of the same static decode run eagerly at the same padded sizes
(``SGLANG_STATIC_DECODE_WITHOUT_GRAPHS``): same kernels, same shapes. One prompt at a time (steps
then do not depend on arrival), then all together with graphs (mixed prefill + decode steps,
batch sizes changing as requests end: every request completes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.engine_graph_check import (
    GRAPH_CHECK_ENGINE_ARGS,
    assert_same_tokens,
    serve_eager_static_then_graphs,
)
from sglang.test.kimi_k3_tiny import CONFIG_A, VOCAB, make_model
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cuda_ci(est_time=50, suite="h200-1gpu")

pytestmark = pytest.mark.gpu
CONFIG_GPU = {**CONFIG_A, "qk_rope_head_dim": 16}
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def _checkpoint(root: Path) -> str:
    src = make_model(CONFIG_GPU, seed=11)
    # the release layout (shards, wrapper config), experts and dense tensors in fp32
    k3_release.write_unquantised(root, CONFIG_GPU, src)
    return str(root)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_k3_graphs_equal_the_eager_static_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = {
        **GRAPH_CHECK_ENGINE_ARGS,
        "model_path": _checkpoint(tmp_path),
        "skip_tokenizer_init": True,
        "context_length": 256,
    }
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 37, 18, 2, 60)]
    batched: list[Any] = []

    def run(engine: Any) -> list[list[int]]:
        singles = [
            engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts
        ]
        batched[:] = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        return singles

    want, got, _, on = serve_eager_static_then_graphs(common, run, monkeypatch)
    assert on.startswith("on (decode batch sizes 1, 2, 4, 8;"), on
    assert_same_tokens(got, want)
    # Together (mixed steps; how they mix depends on arrival, so only the lengths are compared).
    assert [len(r["output_ids"]) for r in batched] == [40] * len(prompts)


if __name__ == "__main__":
    run_this_file(__file__)
