"""The graph test's comparison against the eager reference (40 teacher-forced bf16 decode steps,
``test_deepseek_v4_cuda_graph_gpu.py``'s model, prompts and bounds), with the static decode's
torch attention rounding its probabilities the way a length-aware kernel does before the value
product: ``--parts 0`` keeps fp32 (the torch path), ``2`` / ``3`` keep the sum of that many bf16
parts (the first attention kernel used 2: ~17 bits; 3 hold all 24). No GPU needed: it shows on
the CPU whether a rounding alone moves the static path out of the test's bounds.

    PYTHONPATH=python python scripts/dsv4_kernel_rounding_drift.py --parts 2 --batch 1,3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights

VOCAB = 512
LENGTHS = (5, 100, 230, 20, 61, 7)  # the graph test's
STEPS = 40
PADDED = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8}  # its captured sizes 1, 2, 4, 8


def bf16_parts(p: torch.Tensor, parts: int) -> torch.Tensor:
    """``p`` as the fp32 sum of ``parts`` bf16 parts (greedy: each part rounds the rest)."""
    out, rest = torch.zeros_like(p), p
    for _ in range(parts):
        part = rest.to(torch.bfloat16).float()
        out, rest = out + part, rest - part
    return out


SinkAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def rounded_sink_attention(parts: int) -> SinkAttention:
    """``sink_attention`` with the kernel's order: unnormalised probabilities (rounded to
    ``parts`` bf16 parts) times the keys, divided by the softmax sum at the end."""

    def run(
        q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        bs, heads, _ = q.shape
        kf = keys.float()
        logits = torch.einsum("bhd,bmd->bhm", q.float(), kf) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        full = torch.cat([logits, sink.float().view(1, heads, 1).expand(bs, heads, 1)], dim=-1)
        e = torch.exp(full - full.max(-1, keepdim=True).values)
        probs = bf16_parts(e[..., : keys.shape[1]], parts)
        return torch.einsum("bhm,bmd->bhd", probs, kf) / e.sum(-1, keepdim=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=2, choices=(0, 2, 3))
    parser.add_argument("--batch", default="1,3,6")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if any(b not in PADDED for b in batches):
        raise SystemExit(f"--batch sizes must be 1..6 (the test's prompts), got {args.batch}")
    if args.parts:
        dsv4_static_decode.sink_attention = rounded_sink_attention(args.parts)

    raw = default_model_config(VOCAB, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw), LayerBuildSpec(dtype=torch.bfloat16, device="cpu")
    )
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=len(LENGTHS), capacity=512)
    with torch.no_grad():
        for bs in batches:
            seqs = []
            for i, n in enumerate(LENGTHS[:bs]):
                gen = torch.Generator().manual_seed(100 * bs + i)
                seqs.append(torch.randint(0, VOCAB, (n + STEPS,), generator=gen))
            static = [model.new_pooled_cache() for _ in range(bs)]
            reference = [model.new_request_cache() for _ in range(bs)]
            for seq, n, a, b in zip(seqs, LENGTHS, static, reference):
                model.prefill(seq[:n], a)
                model.prefill(seq[:n], b)
            errors, agree = [], 0
            for t in range(STEPS):
                ids = torch.stack([seq[n + t] for seq, n in zip(seqs, LENGTHS)])
                got = model.decode_pooled(ids, static, pad_to=PADDED[bs]).float()
                ref = model.decode(ids, reference).float()
                errors.append(float((got - ref).abs().mean() / ref.abs().mean()))
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            worst, median = max(errors), sorted(errors)[len(errors) // 2]
            verdict = "within" if worst < 0.05 and agree >= 0.95 * bs * STEPS else "outside"
            print(
                f"parts {args.parts} bs {bs}: worst mean relative error {worst:.4f}, median "
                f"{median:.4f}, greedy {agree}/{bs * STEPS} ({verdict} the test's bounds)",
                flush=True,
            )
            for cache in static:
                model.free_pooled_cache(cache)


if __name__ == "__main__":
    main()
