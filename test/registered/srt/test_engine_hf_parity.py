"""Greedy tokens served from a DeepSeek V4 checkpoint in the release layout (written by the test
kit: FP8 128x128 dense weights with UE8M0 scales, MXFP4 experts, shards, an MTP layer) equal
transformers' greedy decoding of the same prompts on the dequantised weights (fully random tiny
models: hash routing, ratios 0/4/128, YaRN), through the whole serving path: scheduler process,
chunked prefill, the per-request cache across decode steps, sampling.

The second test is the tie case of docs/parity.md: window 16, indexer top-k 5, mixed layer types,
hash-routed first layers, fp32, prompts cut from one random sequence at lengths 30..47 and around
128. Its two indexer heads make exact index-score ties common (an entry whose ReLUs all clip scores
0); transformers' ``torch.topk`` orders ties arbitrarily, so the reference breaks them as our
engine does (the earlier entry; docs/parity.md), and the check is teacher-forced: one reference
forward over ``prompt + served tokens`` per prompt, every served token the reference argmax."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_parity import TIE_CASE_CONFIG, TIE_CASE_LENGTHS, TIE_CASE_SEED
from sglang.test.dsv4_parity import reference_model as tied_reference_model
from sglang.test.dsv4_tiny import CONFIG_A, reference_model, token_ids, write_release
from sglang.test.release_checkpoint.deepseek_v4 import to_transformers
from sglang.test.run import run_this_file

register_cpu_ci(est_time=45)

NEW_TOKENS = 12


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _served(
    path: Path, prompts: list[list[int]], params: dict[str, Any], **engine_args: Any
) -> list[list[int]]:
    """The output ids of ``prompts`` served on CPU from the checkpoint at ``path``."""
    with Engine(
        device="cpu",
        model_path=str(path),
        skip_tokenizer_init=True,
        moe_runner_backend="torch",
        log_level="warning",
        **engine_args,
    ) as engine:
        return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]


def test_served_greedy_equals_transformers(tmp_path: Path) -> None:
    hf = reference_model(CONFIG_A, seed=5)
    ckpt = write_release(tmp_path, CONFIG_A, hf, quantised=True)
    assert ckpt.values is not None
    hf.load_state_dict(to_transformers(ckpt.values))  # what the checkpoint stands for
    prompts = [token_ids(150, CONFIG_A["vocab_size"], seed=s).tolist() for s in (1, 2)]
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    assert _served(tmp_path, prompts, params, chunked_prefill_size=64) == want


@torch.no_grad()
def test_served_greedy_at_the_reported_lengths(tmp_path: Path) -> None:
    hf, ties = tied_reference_model(TIE_CASE_CONFIG, seed=TIE_CASE_SEED)
    ckpt = write_release(tmp_path, TIE_CASE_CONFIG, hf, quantised=True)
    assert ckpt.values is not None
    hf.load_state_dict(to_transformers(ckpt.values))
    seq = token_ids(
        max(TIE_CASE_LENGTHS), TIE_CASE_CONFIG["vocab_size"], seed=TIE_CASE_SEED
    ).tolist()
    prompts = [seq[:n] for n in TIE_CASE_LENGTHS]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    got = _served(tmp_path, prompts, params, dtype="float32", chunked_prefill_size=16)
    wrong = []
    for prompt, out in zip(prompts, got):
        logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
        for step, (row, tok) in enumerate(zip(logits, out)):
            if float(row.max() - row[tok]) > 1e-4:
                wrong.append((len(prompt), step))
    assert not wrong, f"served tokens diverge at (prompt length, step) {wrong}"
    assert ties.count > 0, "the config must exercise tied top-k rows"


if __name__ == "__main__":
    run_this_file(__file__)
