"""The Kimi K3 greedy parity sweep (its test and ``scripts/kimi_k3_parity_sweep.py``). The reference
is :func:`sglang.test.kimi_k3_reference.reference_logits`: a cache-free fp32 forward
written from the K3 description (AttnRes bank and partial sums, naive NoPE MLA with the output
gate, the latent MoE with SiTU) whose KDA is transformers' pure-torch chunked Kimi Linear KDA.

A case is a random tiny K3 (every parameter random; structure random per seed: 2-6 layers with
KDA / MLA anywhere, AttnRes blocks of 1-4 or plain residuals, 0-2 dense layers, 1-3 KDA heads,
conv kernels 2-4, the safe or the softplus gate, full-rank or low-rank gates, q LoRA or not,
output gate or not, latent MoE with or without its norm), prompts cut from one random sequence at
the 64-token KDA chunk boundaries, chunked prefill of all prompts per forward (chunks of 1-3
tokens carry the conv state across forwards shorter than the kernel), then batched greedy
decode (the recurrent KDA step), checked teacher-forced as the DeepSeek V4 sweep is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.test.chunked_prefill import chunked_prefill
from sglang.test.kimi_k3_reference import reference_logits
from sglang.test.kimi_k3_tiny import CONFIG_A, make_model

KDA_CHUNK = 64
# fp32 rounding here is larger than DeepSeek V4's: the chunked and the recurrent KDA sum in other
# orders and random KDA layers amplify it (measured max |diff| ~5e-4 on logits of ~5, relative
# 1e-4); a plumbing error (wrong row, state, bank or norm) shows at >= 1e-2.
REL_TOL = 1e-3
MARGIN_TOL = 1e-3


@dataclass(frozen=True)
class KimiCase:
    seed: int
    config: dict[str, Any]
    prompt_lens: tuple[int, ...]
    new_tokens: int
    chunk: int | None

    @property
    def label(self) -> str:
        c, lin = self.config, self.config["linear_attn_config"]
        kinds = "".join(
            "K" if i + 1 in lin["kda_layers"] else "M" for i in range(c["num_hidden_layers"])
        )
        gate = "safe" if lin["gate_lower_bound"] is not None else "softplus"
        return (
            f"s{self.seed} {kinds} B{c['attn_res_block_size'] or '-'} "
            f"dense{c['first_k_dense_replace']} h{lin['num_heads']} conv"
            f"{lin['short_conv_kernel_size']} {gate} chunk{self.chunk or '-'}"
        )


@dataclass(frozen=True)
class KimiResult:
    case: KimiCase
    max_err: float
    max_ref: float
    near_ties: int
    first_divergence: tuple[int, int] | None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None


def random_kimi_case(
    seed: int, *, max_len: int = 200, num_prompts: int = 2, new_tokens: int = 4
) -> KimiCase:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    kda = [i + 1 for i in range(n) if rng.random() < 0.6]
    if not kda:
        kda = [1]
    heads = rng.choice((1, 2, 3))
    cfg: dict[str, Any] = {
        **CONFIG_A,
        "num_hidden_layers": n,
        "attn_res_block_size": rng.choice((None, 1, 2, 3, 4)),
        "first_k_dense_replace": rng.randint(0, min(2, n)),
        "num_attention_heads": rng.choice((1, 2)),
        "num_key_value_heads": None,
        "q_lora_rank": rng.choice((None, 24)),
        "mla_use_output_gate": rng.random() < 0.5,
        "num_experts": rng.choice((4, 8)),
        "num_experts_per_token": rng.randint(1, 3),
        "num_shared_experts": rng.choice((1, 2)),
        "routed_expert_hidden_size": rng.choice((None, 32)),
        "latent_moe_use_norm": rng.random() < 0.5,
        "routed_scaling_factor": rng.choice((1.0, 2.5)),
        "linear_attn_config": {
            **CONFIG_A["linear_attn_config"],
            "kda_layers": kda,
            "full_attn_layers": [i + 1 for i in range(n) if i + 1 not in kda],
            "num_heads": heads,
            "head_dim": rng.choice((8, 16)),
            "short_conv_kernel_size": rng.choice((2, 3, 4)),
            "use_full_rank_gate": rng.random() < 0.5,
            "gate_lower_bound": rng.choice((-5.0, None)),
        },
    }
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    marks = [1, 2, 3, KDA_CHUNK - 1, KDA_CHUNK, KDA_CHUNK + 1, 2 * KDA_CHUNK, 2 * KDA_CHUNK + 1]
    marks += [rng.randint(1, max_len) for _ in range(4)]
    lens = sorted(rng.sample([m for m in marks if m <= max_len], num_prompts))
    chunk = rng.choice((None, 1, 2, 3, 63, 65) if max(lens) <= 70 else (None, 3, 63, 65))
    return KimiCase(seed, cfg, tuple(lens), new_tokens, chunk)


@torch.no_grad()
def _generate(
    model: KimiK3ForCausalLM, prompts: Sequence[torch.Tensor], new_tokens: int, chunk: int | None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    caches = [model.new_request_cache() for _ in prompts]
    rows = chunked_prefill(model, prompts, caches, chunk)
    tokens = [[int(torch.cat(r)[-1].argmax())] for r in rows]
    for _ in range(new_tokens - 1):
        logits = model.decode(torch.tensor([t[-1] for t in tokens]), caches)
        for i, t in enumerate(tokens):
            rows[i].append(logits[i : i + 1])
            t.append(int(logits[i].argmax()))
    return tokens, [torch.cat(r).float() for r in rows]


@torch.no_grad()
def run_kimi_case(case: KimiCase, *, margin_tol: float = MARGIN_TOL) -> KimiResult:
    model = make_model(case.config, seed=case.seed)
    vocab = case.config["vocab_size"]
    g = torch.Generator().manual_seed(case.seed + 104729)
    seq = torch.randint(0, vocab, (max(case.prompt_lens),), generator=g)
    prompts = [seq[:n] for n in case.prompt_lens]
    tokens, logits = _generate(model, prompts, case.new_tokens, case.chunk)
    max_err = max_ref = 0.0
    near = 0
    first: tuple[int, int] | None = None
    for prompt, out, got in zip(prompts, tokens, logits):
        full = torch.cat([prompt, torch.tensor(out[:-1], dtype=torch.long)])
        ref = reference_logits(model, full)
        max_err = max(max_err, float((got - ref).abs().max()))
        max_ref = max(max_ref, float(ref.abs().max()))
        chosen = got.argmax(-1)
        for row in range(ref.shape[0]):
            pick, best = int(chosen[row]), int(ref[row].argmax())
            if pick == best:
                continue
            if float(ref[row, best] - ref[row, pick]) <= margin_tol:
                near += 1
            elif first is None:
                first = (prompt.shape[0], row)
    return KimiResult(case, max_err, max_ref, near, first)
