"""Greedy tokens served from a transformers ``save_pretrained`` DeepSeek V4 directory equal
transformers' own greedy decoding of the same prompt (a fully random tiny model: hash routing,
ratios 0/4/128, YaRN), through the whole serving path: scheduler process, chunked prefill, the
per-request cache across decode steps, sampling."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from _dsv4_testing import CONFIG_A, reference_model, token_ids

register_cpu_ci(est_time=25)

NEW_TOKENS = 12


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_served_greedy_equals_transformers(tmp_path: Path) -> None:
    hf = reference_model(CONFIG_A, seed=5)
    hf.save_pretrained(tmp_path)
    prompts = [token_ids(150, CONFIG_A["vocab_size"], seed=s).tolist() for s in (1, 2)]
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(
        device="cpu", model_path=str(tmp_path), skip_tokenizer_init=True, chunked_prefill_size=64,
        moe_runner_backend="torch", log_level="warning",
    ) as engine:  # fmt: skip
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert got == want


if __name__ == "__main__":
    run_this_file(__file__)
