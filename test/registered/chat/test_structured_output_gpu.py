"""Structured output on CUDA (run on the H200; skipped elsewhere): xgrammar's bitmask kernel
against the torch reference at DeepSeek V4's vocabulary for a batch of 64, and the engine with
decode CUDA graphs on, where the mask is applied to the graph's logits afterwards: constrained,
unconstrained and ``n > 1`` requests decode together (prefill chunks mixed with decodes), and
every constrained output is valid JSON matching its schema or matches its regex."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from sglang import Engine
from sglang.srt.sampling.token_bitmask import (
    apply_token_bitmask_,
    apply_token_bitmask_torch,
    bitmask_words,
)
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=90, suite="h200-1gpu")


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    v = json.loads(text)
    return (
        set(v) == {"ok", "n", "tag"}
        and isinstance(v["ok"], bool)
        and isinstance(v["n"], int)
        and 0 <= v["n"] <= 99
        and re.fullmatch("[a-z]{1,6}", v["tag"]) is not None
    )


@pytest.mark.parametrize("batch", [1, 64])
def test_bitmask_kernel_matches_torch(batch: int) -> None:
    vocab = 129280
    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, vocab, device="cuda", generator=g)
    words = bitmask_words(vocab)
    cpu = torch.Generator().manual_seed(batch)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=cpu, dtype=torch.int64)
    mask = mask.to(torch.int32)
    if batch > 1:
        mask[0] = -1  # an unconstrained row beside constrained ones
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask_(got, mask)  # xgrammar's kernel on the device
    apply_token_bitmask_torch(want, mask.cuda())
    assert torch.equal(got, want)
    constrained = got[1:] if batch > 1 else got
    assert (
        torch.isinf(constrained).all(dim=1).logical_not().all() and torch.isinf(constrained).any()
    )
    if batch > 1:
        assert torch.equal(got[0], logits[0])


def test_engine_graphs_mixed_batch_constrained_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights spend many tokens on the whitespace JSON allows; keep its runs short.
    monkeypatch.setenv("SGLANG_GRAMMAR_MAX_WHITESPACE", "2")
    schema = json.dumps(SCHEMA)
    prompts = ["Tell me about cats", "x" * 600, "Hello", "Numbers:"]
    params = [
        {"json_schema": schema, "max_new_tokens": 160, "n": 3, "temperature": 0.8, "seed": 1},
        {"max_new_tokens": 48, "ignore_eos": True},  # a long prefill beside the decodes
        {"regex": "[a-c]{2}-[0-9]{1,4}", "max_new_tokens": 16, "temperature": 0},
        {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
    ]
    with Engine(device="cuda", random_seed=0, log_level="warning", chunked_prefill_size=128) as e:
        out = e.generate(prompts, params)
        info = e.get_server_info()
    assert info["model_info"]["cuda_graph"].startswith("on"), info["model_info"]["cuda_graph"]
    json_outs = out[:3]
    for r in json_outs:
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
        assert _valid(r["text"]), r["text"]
    assert len({r["text"] for r in json_outs}) > 1  # each choice has its own matcher
    assert len(out[3]["output_ids"]) == 48
    assert re.fullmatch("[a-c]{2}-[0-9]{1,4}", out[4]["text"]), out[4]["text"]
    assert len(out[5]["output_ids"]) == 32


if __name__ == "__main__":
    run_this_file(__file__)
