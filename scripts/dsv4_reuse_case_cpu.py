"""The reused-slot case of ``test_deepseek_v4_cuda_graph_gpu.py`` on the CPU, with the length-aware
kernels under the Triton interpreter or the torch path, against the eager reference decode.

The built-in model (bf16 by default), random weights (seed 7), a paged pool with blocks of 128
tokens: a request prefilled to 260 tokens and decoded to 300 (padded to 2 rows) is freed; its
slot is reused from a 3-token prompt, decoded to 30 tokens. Prints the mean relative logit error
of each of those 27 steps against the eager decode on a per-request cache (the test's bound:
0.05). The interpreter's bf16 ``tl.dot`` returns garbage, so with a bf16 model the kernels get
fp32 copies of their bf16 inputs (the GPU's bf16 MMA with fp32 accumulation computes the same up
to summation order).

    PYTHONPATH=python python scripts/dsv4_reuse_case_cpu.py --path kernels
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import torch

from sglang.kernels.ops.attention import indexer_scores as scores_mod
from sglang.kernels.ops.attention import sparse_decode_attention as attention_mod
from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.deepseek_v4_loader import load_weights
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

VOCAB = 512


def _f32(t: object) -> object:
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _fp32_kernels() -> None:
    """Route the static decode's kernel calls through fp32 copies of their float inputs."""

    def attention(*args: object, **kwargs: object) -> torch.Tensor:
        args = tuple(_f32(a) for a in args)
        kwargs = {k: _f32(v) for k, v in kwargs.items()}
        return attention_mod.sparse_decode_attention(*args, **kwargs)  # type: ignore[arg-type]

    def scores(*args: object, **kwargs: object) -> torch.Tensor:
        args = tuple(_f32(a) for a in args)
        return scores_mod.indexer_scores(*args, **kwargs)  # type: ignore[arg-type]

    dsv4_static_decode.sparse_decode_attention = attention  # type: ignore[assignment]
    dsv4_static_decode.indexer_scores = scores  # type: ignore[assignment]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _mean_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().mean() / ref.float().abs().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("kernels", "torch"), default="kernels")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors; the interpreter is the cost
    _fp32_kernels()
    use_kernels = args.path == "kernels"
    dsv4_static_decode.use_sparse_kernels = lambda *a: use_kernels  # type: ignore[assignment]

    raw = default_model_config(VOCAB, 0, 1)
    spec = LayerBuildSpec(dtype=getattr(torch, args.dtype), device="cpu")
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(raw), spec)
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=18, capacity=512, block_tokens=128)
    with torch.no_grad():
        first, seq = model.new_pooled_cache(), _ids(300, 1)
        model.prefill(seq[:260], first)
        for t in range(260, 300):
            model.decode_pooled(seq[t : t + 1], [first], pad_to=2)
        model.free_pooled_cache(first)
        reused, fresh, short = model.new_pooled_cache(), model.new_request_cache(), _ids(30, 2)
        model.prefill(short[:3], reused)
        model.prefill(short[:3], fresh)
        errs = []
        for t in range(3, 30):
            got = model.decode_pooled(short[t : t + 1], [reused], pad_to=2)
            errs.append(_mean_rel(got, model.decode(short[t : t + 1], [fresh])))
    print(f"{args.path}, {args.dtype}: worst mean relative error {max(errs):.4f} (bound 0.05)")
    print("per step: " + " ".join(f"{e:.4f}" for e in errs))


if __name__ == "__main__":
    main()
