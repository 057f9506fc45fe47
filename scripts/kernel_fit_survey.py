"""Which Triton kernels of a model's forward fit the H200, per dtype: compiled for sm_90 on this
CPU machine (``sglang.test.sm90_compile.sm90_dry_run``), never run.

A one-layer-per-kind DeepSeek V4 (the wide bench shape: hidden 4096, 64 heads of 512, ratios
0/4/128) and Kimi K3 (hidden 7168, KDA 96x128, MLA 64 heads, latent experts 3584x3072) are built
on CPU with few experts and run through a prefill and a decode step. Every kernel launch is bound
as the GPU would bind it and compiled; the table lists shared memory, registers, and whether it
fits the H200 (232448 B shared a block). A kernel over the limit is one the engine must not
choose (``sglang.kernels.fit``); the table is how such a kernel is found.

Usage: python scripts/kernel_fit_survey.py [--models dsv4,k3] [--dtypes bfloat16,float16,float32]
  [--prefill 512] [--decode-batch 4] [--registers]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from sglang.kernels.fit.limits import H200
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.test.sm90_compile import DryRun, sm90_dry_run
from sglang.test.wide_dsv4 import wide_dsv4_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def k3_survey_config(experts: int) -> dict[str, Any]:
    """The K3 bench model (``bench_kimi_k3_layers.k3_config``) with a third layer of MLA, a
    dense layer 0 of intermediate 2048 and top-4 routing over ``experts`` experts."""
    from bench_kimi_k3_layers import k3_config  # scripts/ is on sys.path

    config = k3_config(experts)
    config.update(num_hidden_layers=3, intermediate_size=2048, num_experts_per_token=4)
    config.pop("attn_res_block_size")
    config["linear_attn_config"] = {**config["linear_attn_config"], "full_attn_layers": [3]}
    return config


def build(model: str, dtype: torch.dtype, runner: str) -> Any:
    from sglang.srt.layers.moe.moe_runner.triton_runner import TritonMoERunner

    # The runner refuses CPU devices; here its launches are compiled, not run.
    TritonMoERunner.unavailable_reason = lambda self, device: None  # type: ignore[method-assign]
    spec = LayerBuildSpec(dtype=dtype, device="cpu", moe_runner=runner)
    if model == "dsv4":
        from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
        from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

        cfg = wide_dsv4_config([0, 4, 128], num_hash_layers=1)
        cfg["n_routed_experts"] = 8
        return DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(cfg), spec).eval()
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
    from sglang.srt.models.kimi_k3_config import KimiK3Config

    return KimiK3ForCausalLM(KimiK3Config.from_dict(k3_survey_config(8)), spec).eval()


@contextlib.contextmanager
def cuda_tensors_claimed() -> Iterator[None]:
    """CPU tensors answer ``is_cuda`` with True, so the layers' CUDA-only kernel choices (mHC,
    decode attention, indexer...) are taken and their launches recorded."""
    real, capturing = torch.Tensor.is_cuda, torch.cuda.is_current_stream_capturing
    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[method-assign,assignment]
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        torch.Tensor.is_cuda = real  # type: ignore[method-assign]
        torch.cuda.is_current_stream_capturing = capturing


@torch.no_grad()
def survey(model_name: str, dtype: torch.dtype, prefill: int, batch: int, dry: DryRun) -> None:
    model = build(model_name, dtype, "triton")
    for p in model.parameters():  # finite values: host code may look at routing results
        p.data.normal_(0, 0.02)
    for layer in model.moe_layers():
        c = layer.config
        w13 = torch.randn(c.num_experts, 2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        w2 = torch.randn(c.num_experts, c.hidden_size, c.intermediate_size, dtype=dtype)
        layer.load_weights(ExpertWeights(w13 * 0.02, w2 * 0.02))
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (prefill,))
    caches = [model.new_request_cache() for _ in range(batch)]
    with cuda_tensors_claimed():
        for c in caches:
            model.prefill(ids, c)
        model.decode(ids[:batch], caches)
        # The static decode (what CUDA graphs capture): caches in the model's slot pool.
        model.enable_slot_pool(batch + 1, prefill + 16)
        pooled = [model.new_pooled_cache() for _ in range(batch)]
        for c in pooled:
            model.prefill(ids, c)
        model.decode_pooled(ids[:batch], pooled, pad_to=batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--registers", action="store_true", help="also run ptxas -v per kernel")
    args = parser.parse_args()
    over = 0
    print("| model | dtype | kernel | warps | stages | shared B | regs | fits H200 |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for name in args.dtypes.split(","):
            with sm90_dry_run(registers=args.registers) as dry:
                try:
                    survey(model, DTYPES[name], args.prefill, args.decode_batch, dry)
                except Exception as exc:  # noqa: BLE001 - a host-side stop ends this model only
                    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                    print(f"| {model} | {name} | (stopped: {type(exc).__name__}: {first}) |")
            for r in dry.records:
                fits = (
                    "compile error: " + (r.error or "")[:120]
                    if r.error
                    else ("yes" if (r.shared or 0) <= H200.shared_optin_bytes else "NO")
                )
                over += fits != "yes"
                kernel = r.kernel.removeprefix("sglang.kernels.ops.")
                print(
                    f"| {model} | {name} | {kernel} | {r.num_warps} | {r.num_stages} | "
                    f"{r.shared} | {r.registers or ''} | {fits} |"
                )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
