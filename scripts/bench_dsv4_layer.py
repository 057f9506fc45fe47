"""One DeepSeek V4 decoder layer at realistic width on one GPU, per MoE runner: a prefill of
``--prefill`` tokens and one decode step for ``--batch`` requests (CUDA events, median).

Config: hidden 4096, 256 routed experts top-6 (intermediate 2048), one shared expert, 64 heads of
512 (q rank 1024, 8 output groups), ratio-4 compressed attention with the indexer, random weights.
Usage: python scripts/bench_dsv4_layer.py [--runners torch,triton] [--prefill 1024] [--batch 1,8,32]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from tqdm import tqdm

from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.wide_dsv4 import wide_dsv4_config

LAYER = wide_dsv4_config([4])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runners", default="torch,triton")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--batch", default="1,8,32")
    args = parser.parse_args()
    weights = random_weights(LAYER, seed=0)
    rows = []
    for runner in tqdm(args.runners.split(","), desc="runners"):
        model = DeepseekV4ForCausalLM(
            DeepseekV4ModelConfig.from_dict(LAYER),
            LayerBuildSpec(dtype=torch.bfloat16, device="cuda", moe_runner=runner),
        )
        load_weights(model, weights, LoadOptions(progress=False))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, LAYER["vocab_size"], (args.prefill,), generator=gen).cuda()
        pos = torch.arange(args.prefill, device="cuda")
        rows.append(
            (runner, f"prefill {args.prefill}", median_cuda_ms(partial(model, ids, pos), repeats=5))
        )
        for b in (int(x) for x in args.batch.split(",")):
            caches = [model.new_request_cache() for _ in range(b)]
            for c in caches:
                model.prefill(ids[:256], c)
            tok = ids[:b]
            # consecutive real decode steps (each extends every cache by one token)
            rows.append(
                (
                    runner,
                    f"decode bs={b}",
                    median_cuda_ms(partial(model.decode, tok, caches), repeats=9),
                )
            )
        del model
        torch.cuda.empty_cache()
    print(f"\n{'runner':<8} {'case':<24} {'ms':>9}")
    for runner, case, ms in rows:
        print(f"{runner:<8} {case:<24} {ms:>9.2f}")


if __name__ == "__main__":
    main()
