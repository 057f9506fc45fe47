"""The prefix cache on CUDA with decode CUDA graphs (run on the H200; skipped elsewhere): the
built-in DeepSeek V4 and a tiny Kimi K3, fp32 with the triton MoE runner (the graph check's
engine: 8-row graphs, 16-token prefill chunks), token ids in.

- Shared prompts (one request at a time): requests that share 255 .. 513 tokens of a 600-token
  prompt resume at the last block edge they share (256-token blocks; K3 with 64-token blocks),
  where the first prompt's prefill left a snapshot, prefill the rest mid-prompt and decode
  through the graphs.
  Every prefill chunk ends on a multiple of 16, so the forwards after the hit are the very ones
  the same request does from an empty cache (served right after a flush): greedy tokens and
  log-probs must be equal, not merely close.
- A conversation on DeepSeek V4 (each turn resumes at the snapshot its previous turn saved while
  decoding across a block edge) and two continuations of it served together (mixed steps: one
  request's prefill from the cache beside the other's decode rows in the graphs): every output
  token's log-prob equals, within fp32/TF32 rounding, the same token's log-prob when the whole
  sequence is prefilled from an empty cache, and stays the greedy choice there (a wrong window
  row, entry or state moves log-probs by O(1)).
- ``Engine.flush_cache()`` empties the cache (rank 0's pool all free) between phases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang import Engine
from sglang.test.ci_register import register_cuda_ci
from sglang.test.engine_graph_check import GRAPH_CHECK_ENGINE_ARGS
from sglang.test.kimi_k3_tiny import CONFIG_A, make_model
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cuda_ci(est_time=180, suite="h200-1gpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Teacher-forced log-prob agreement: fp32 with TF32 dots, decode rows against prefill rows.
LOGPROB_TOL = 0.05


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(e: Engine, ids: list[int] | list[list[int]], n: int) -> Any:
    return e.generate(input_ids=ids, sampling_params=_greedy(n), return_logprob=True)


def _flush(e: Engine) -> None:
    assert e.flush_cache()["ok"]
    stats = e.get_server_info()["scheduler"]
    assert stats["free_blocks"] == stats["total_blocks"] and stats["cache_tokens"] == 0


def _shared_prompts_resume_exactly(
    e: Engine, vocab: int, base_len: int, shared: dict[int, int]
) -> None:
    """``shared``: tokens shared with the base prompt -> the tokens the request must resume."""
    base = _ids(base_len, vocab, seed=1)
    _flush(e)
    _serve(e, base, 2)
    prompts = {s: base[:s] + _ids(base_len - s, vocab, seed=100 + s) for s in shared}
    on = {s: _serve(e, p, 24) for s, p in prompts.items()}
    for s, prompt in prompts.items():
        _flush(e)
        off = _serve(e, prompt, 24)
        got = on[s]
        assert got["meta_info"]["cached_tokens"] == shared[s], (s, got["meta_info"])
        assert off["meta_info"]["cached_tokens"] == 0
        assert got["output_ids"] == off["output_ids"], s
        lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        assert lp == [x[0] for x in off["meta_info"]["output_token_logprobs"]], s


def _teacher_forced_agreement(
    e: Engine, results: dict[str, Any], prompts: dict[str, list[int]]
) -> None:
    for rid, result in results.items():
        prompt, out = prompts[rid], result["output_ids"]
        _flush(e)
        ref = e.generate(
            input_ids=prompt + out,
            sampling_params=_greedy(1),
            return_logprob=True,
            logprob_start_len=len(prompt),
            top_logprobs_num=1,
        )["meta_info"]
        forced = [x[0] for x in ref["input_token_logprobs"]]
        best = [top[0][0] for top in ref["input_top_logprobs"]]
        got = [x[0] for x in result["meta_info"]["output_token_logprobs"]]
        assert len(forced) == len(got) == len(out)
        worst = max(abs(a - b) for a, b in zip(got, forced))
        assert worst < LOGPROB_TOL, (rid, worst)
        assert all(f >= b - LOGPROB_TOL for f, b in zip(forced, best)), rid


@pytest.fixture(scope="module")
def dsv4() -> Iterator[Engine]:
    with Engine(**GRAPH_CHECK_ENGINE_ARGS, context_length=2048) as e:
        info = e.get_server_info()["model_info"]
        assert info["cuda_graph"].startswith("on (decode batch sizes 1, 2, 4, 8"), info
        assert info["prefix_cache"].startswith("on (radix tree over 256-token blocks"), info
        yield e


def test_dsv4_shared_prompts_resume_exactly_with_graphs(dsv4: Engine) -> None:
    vocab = dsv4.get_server_info()["model_info"]["vocab_size"]
    # The base prompt keeps the snapshot at its last block edge (512); the ones its 16-token
    # chunks saved at earlier edges were superseded. The first request that diverges at 256
    # recomputes to it and saves one there, from which the later ones resume.
    shared = {255: 0, 256: 0, 257: 256, 300: 256, 511: 256, 512: 512, 513: 512}
    _shared_prompts_resume_exactly(dsv4, vocab, 600, shared)


def test_dsv4_conversation_and_branches_with_graphs(dsv4: Engine) -> None:
    vocab = dsv4.get_server_info()["model_info"]["vocab_size"]
    _flush(dsv4)
    prompts: dict[str, list[int]] = {"t0": _ids(300, vocab, seed=7)}
    results = {"t0": _serve(dsv4, prompts["t0"], 240)}  # decodes across the 512 edge
    for k in (1, 2):
        prev = f"t{k - 1}"
        prompts[f"t{k}"] = prompts[prev] + results[prev]["output_ids"] + _ids(40, vocab, seed=k)
        results[f"t{k}"] = _serve(dsv4, prompts[f"t{k}"], 60)
        seen = len(prompts[prev]) + len(results[prev]["output_ids"]) - 1
        assert results[f"t{k}"]["meta_info"]["cached_tokens"] == seen // 256 * 256 > 0
    stem = prompts["t2"] + results["t2"]["output_ids"]
    prompts["left"], prompts["right"] = stem + _ids(30, vocab, seed=9), stem + [5]
    left, right = _serve(dsv4, [prompts["left"], prompts["right"]], 20)
    results.update(left=left, right=right)
    for r in (left, right):
        assert r["meta_info"]["cached_tokens"] > 0
    _teacher_forced_agreement(dsv4, results, prompts)


def test_k3_shared_prompts_resume_exactly_with_graphs(tmp_path: Path) -> None:
    config = {**CONFIG_A, "qk_rope_head_dim": 16}  # the absorbed MLA kernel's widths
    src = make_model(config, seed=11)
    k3_release.write_unquantised(tmp_path, config, src)
    with Engine(
        **GRAPH_CHECK_ENGINE_ARGS,
        model_path=str(tmp_path),
        skip_tokenizer_init=True,
        context_length=1024,
        page_size=64,
    ) as e:
        info = e.get_server_info()["model_info"]
        assert info["cuda_graph"].startswith("on (decode batch sizes 1, 2, 4, 8"), info
        assert info["prefix_cache"].startswith("on (radix tree over 64-token blocks"), info
        # Snapshots: the base prompt's at 256 (its last block edge); then each first divergence
        # at an edge without one (64, 128, 192) recomputes to it and saves one there.
        shared = {63: 0, 64: 0, 65: 64, 127: 64, 128: 64, 129: 128, 250: 128}
        _shared_prompts_resume_exactly(e, info["vocab_size"], 300, shared)


if __name__ == "__main__":
    run_this_file(__file__)
