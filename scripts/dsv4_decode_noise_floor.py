"""How far one bf16 static decode step of the built-in DeepSeek V4 model moves when its attention
output is perturbed at the level of an fp32 summation-order difference.

The model-level kernel test compares the length-aware kernels with the torch path; their
attention outputs agree to ~1e-7..1e-6 relative, yet the logits after one step differ by ~1e-2.
This script shows that the torch path alone does the same: it decodes one step from identical
prefilled caches (the test's lengths and seeds) once plainly and ``--trials`` times with every
layer's attention output scaled by ``1 + eps * N(0, 1)``, and prints the mean relative logit
error and the per-row errors of each trial.

    python scripts/dsv4_decode_noise_floor.py --device cuda --eps 1e-6
"""

from __future__ import annotations

import argparse

import torch

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights

LENGTHS = (3, 30, 31, 100, 127, 250)
VOCAB = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    if args.trials < 1:
        raise SystemExit(f"--trials must be >= 1, got {args.trials}")

    raw = default_model_config(VOCAB, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw),
        LayerBuildSpec(dtype=torch.bfloat16, device=args.device),
    )
    load_weights(model, random_weights(raw, seed=3), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=len(LENGTHS) * (args.trials + 1), capacity=512)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n + 1,), generator=gen).to(args.device) for n in LENGTHS]
    sets = [[model.new_pooled_cache() for _ in LENGTHS] for _ in range(args.trials + 1)]
    with torch.no_grad():
        for caches in sets:
            for seq, n, cache in zip(seqs, LENGTHS, caches):
                model.prefill(seq[:n], cache)
    ids = torch.stack([seq[n] for seq, n in zip(seqs, LENGTHS)])

    # The torch path in both runs (the kernels are what this floor is compared against).
    dsv4_static_decode.use_sparse_kernels = lambda *a: False  # type: ignore[assignment]
    plain = dsv4_static_decode._torch_attention

    def noisy(*a: object) -> torch.Tensor:
        o = plain(*a)  # type: ignore[arg-type]
        return o * (1 + args.eps * torch.randn_like(o))

    want = model.decode_pooled(ids, sets[0])
    dsv4_static_decode._torch_attention = noisy  # type: ignore[assignment]
    for i in range(args.trials):
        torch.manual_seed(i)
        got = model.decode_pooled(ids, sets[i + 1])
        scale = want.abs().mean()
        rel = float((got - want).abs().mean() / scale)
        per_row = ", ".join(f"{float(r):.3f}" for r in (got - want).abs().mean(-1) / scale)
        same = int((got.argmax(-1) == want.argmax(-1)).sum())
        print(
            f"eps {args.eps:g} trial {i}: mean relative logit error {rel:.4f} "
            f"(rows {per_row}), greedy equal {same}/{len(LENGTHS)}"
        )


if __name__ == "__main__":
    main()
