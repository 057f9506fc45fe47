"""KV bytes per token and the most concurrent 8k-token requests one H200 holds, per
``--kv-cache-dtype``, for DeepSeek V4-Flash and Kimi K3: the server's own memory models (no GPU
needed), one table.

Per GPU of a deployment over ``--gpus`` H200s with attention tensor-parallel and the experts
expert-parallel (every weight split over the GPUs; the MQA KV head / MLA latent is whole on every
rank, so each GPU holds every running request's cache: its capacity is the deployment's):

- weights in the checkpoint's format: routed experts MXFP4 (4.25 bits a value: E2M1 pairs plus one
  UE8M0 scale per 32), DeepSeek V4's attention projections and shared experts FP8 with 128 x 128
  block scales, everything else bf16 (vectors fp32), counted from the model's parameter shapes;
- the cache room: ``--mem-fraction-static`` of the GPU minus that share of the weights;
- the most requests of ``--request-tokens`` (prompt + output, whole blocks) that fit with their
  fixed state (DeepSeek V4's window rings, Kimi K3's KDA states of this rank's heads), the step
  workspace (a ``--chunk`` prefill chunk plus the decodes, ``--logit-rows`` logit rows) and their
  cached tokens at the memory model's bytes per token.

Each model is shown with its weights as shipped (``shipped``) and all dequantised to bf16
(``bf16``), so the table says what keeping the checkpoint's formats resident buys.

Usage: PYTHONPATH=python python scripts/kv_cache_capacity.py [--gpus-dsv4 8] [--gpus-k3 16]
       [--request-tokens 8192] [--gpu-gib 139.8] [--mem-fraction 0.85]
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from sglang.bench_table import markdown_table
from sglang.srt.default_model.generate import parameter_shapes
from sglang.srt.layers.attention.dsv4_kv_layout import DeepseekV4KVLayout
from sglang.srt.layers.attention.mla_kv_layout import KimiK3KVLayout
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.block_pool import blocks_for
from sglang.srt.mem_cache.deepseek_v4_slot_pool import default_block_tokens
from sglang.srt.mem_cache.kimi_k3_slot_pool import DEFAULT_BLOCK_TOKENS
from sglang.srt.mem_cache.memory_models.deepseek_v4 import CacheShape
from sglang.srt.mem_cache.memory_models.kimi_k3 import KimiK3MemoryModel
from sglang.srt.mem_cache.memory_models.memory_model import MemoryModel
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3_config import KimiK3Config

MXFP4 = 0.5 + 1 / 32  # bytes a value: two E2M1 a byte, a UE8M0 byte per 32
FP8_BLOCK = 1 + 4 / (128 * 128)  # e4m3 plus an fp32 scale per 128 x 128 block

# DeepSeek V4-Flash (the published config): 43 layers, 2 sliding, then ratio 4 / 128 alternating.
DSV4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "swiglu_limit": 10.0, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
    "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "tie_word_embeddings": False,
}  # fmt: skip

# Kimi K3 (design/kimi_k3.md): 93 layers, MLA at 1-based 4, 8, ..., 92 and 93, KDA elsewhere.
_K3_MLA = [*range(4, 93, 4), 93]
KIMI_K3: dict[str, Any] = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168,
    "num_hidden_layers": 93, "intermediate_size": 33792, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "attn_res_block_size": 12,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 94) if i not in _K3_MLA],
        "full_attn_layers": _K3_MLA, "num_heads": 96, "head_dim": 128,
        "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
    },
    "tie_word_embeddings": False, "max_position_embeddings": 1048576,
}  # fmt: skip


# --weights: "shipped" keeps the checkpoint's formats resident (what the engine does on CUDA);
# "bf16" dequantises every matrix to bf16 (what serving would cost without the 4-bit and FP8
# paths).
WEIGHT_FORMATS = ("shipped", "bf16")


def dsv4_weight_bytes(raw: dict[str, Any], shipped: bool = True) -> float:
    fp8 = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", "shared_experts", "indexer.wq_b.")
    total = 0.0
    for name, shape in parameter_shapes(raw).items():
        n = math.prod(shape)
        if len(shape) < 2:
            total += n * 4
        elif not shipped:
            total += n * 2
        elif ".ffn.experts." in name:
            total += n * MXFP4
        elif any(k in name for k in fp8) and "compressor" not in name:
            total += n * FP8_BLOCK
        else:
            total += n * 2
    return total


def k3_weight_bytes(raw: dict[str, Any], shipped: bool = True) -> float:
    """Dense from a meta-device model (bf16; vectors fp32), routed experts counted (MXFP4 as
    shipped, else bf16)."""
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM

    cfg = KimiK3Config.from_dict(raw)
    model = KimiK3ForCausalLM(cfg, LayerBuildSpec(dtype=torch.float32, device="meta"))
    dense = sum(p.numel() * (2 if p.dim() >= 2 else 4) for p in model.parameters())
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    width = raw["routed_expert_hidden_size"] or raw["hidden_size"]
    experts = moe_layers * raw["num_experts"] * 3 * raw["moe_intermediate_size"] * width
    return dense + experts * (MXFP4 if shipped else 2)


@dataclass(frozen=True)
class Row:
    model: str
    weights: str
    model_weights_gib: float
    kv: str
    bytes_per_token: float
    per_layer: str
    weights_gib: float
    room_gib: float
    requests: int
    tokens: int


def most_requests(shape: MemoryModel, room: float, request_tokens: int, block: int,
                  chunk: int, logit_rows: int) -> int:  # fmt: skip
    """The most requests of ``request_tokens`` whose caches, fixed state and step workspace fit."""
    per = blocks_for(request_tokens, block) * block * shape.bytes_per_cached_token()

    def fits(n: int) -> bool:
        need = shape.workspace_bytes(chunk + n, max(logit_rows, n))
        return need + shape.fixed_bytes(n, request_tokens) + n * per <= room

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus-dsv4", type=int, default=8)
    parser.add_argument("--gpus-k3", type=int, default=16)
    parser.add_argument("--request-tokens", type=int, default=8192)
    parser.add_argument("--gpu-gib", type=float, default=139.8)
    parser.add_argument("--mem-fraction", type=float, default=0.85)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--logit-rows", type=int, default=512)
    args = parser.parse_args()
    gib = float(1 << 30)
    gpu = args.gpu_gib * gib * args.mem_fraction
    rows: list[Row] = []

    dsv4_cfg = DeepseekV4ModelConfig.from_dict(DSV4_FLASH)
    block = default_block_tokens(tuple(dsv4_cfg.compress_ratios))
    for fmt, kv in itertools.product(WEIGHT_FORMATS, ("bf16", "fp8_e4m3")):
        whole = dsv4_weight_bytes(DSV4_FLASH, fmt == "shipped")
        layout = DeepseekV4KVLayout.build(
            head_dim=dsv4_cfg.head_dim, rope_dim=dsv4_cfg.rope_head_dim,
            index_head_dim=dsv4_cfg.index_head_dim, dtype=torch.bfloat16, kv_cache_dtype=kv,
        )  # fmt: skip
        shape = CacheShape.from_model_config(
            dsv4_cfg, 2, entry_bytes=layout.entries.row_bytes,
            index_key_bytes=layout.index_keys.row_bytes, kv_cache=kv,
        )  # fmt: skip
        kinds = sorted({(r, k) for r, k in zip(shape.compress_ratios, shape.attn_types) if r})
        per_layer = ", ".join(
            f"r{r}{'+idx' if k == 'csa' else ''} {shape.layer_bytes_per_token(r, k):.1f}"
            for r, k in kinds
        )
        rows.append(
            _row("DeepSeek V4-Flash", fmt, whole, args.gpus_dsv4, kv, shape, per_layer, gpu, args,
                 block)
        )  # fmt: skip

    k3_cfg = KimiK3Config.from_dict(KIMI_K3)
    heads = k3_cfg.kda_num_heads // args.gpus_k3
    for fmt, kv in itertools.product(WEIGHT_FORMATS, ("bf16", "fp8_e4m3")):
        whole = k3_weight_bytes(KIMI_K3, fmt == "shipped")
        layout = KimiK3KVLayout.build(
            kv_lora_rank=k3_cfg.kv_lora_rank, rope_dim=k3_cfg.qk_rope_head_dim,
            dtype=torch.bfloat16, kv_cache_dtype=kv,
        )  # fmt: skip
        mm = KimiK3MemoryModel(
            pool=k3_cfg.cache_shape(kda_heads=heads), hidden_size=k3_cfg.hidden_size,
            vocab_size=k3_cfg.vocab_size, bank_rows=k3_cfg.num_bank_rows, dtype_bytes=2,
            state_dtype_bytes=4, latent_row_bytes=layout.latents.row_bytes, kv_cache=kv,
        )  # fmt: skip
        per_layer = f"MLA {mm.latent_bytes}"
        rows.append(
            _row("Kimi K3", fmt, whole, args.gpus_k3, kv, mm, per_layer, gpu, args,
                 DEFAULT_BLOCK_TOKENS)
        )  # fmt: skip

    print(
        f"One H200 ({args.gpu_gib} GiB, --mem-fraction-static {args.mem_fraction}); DeepSeek "
        f"V4-Flash over {args.gpus_dsv4} GPUs, Kimi K3 over {args.gpus_k3} (weights split, "
        f"attention TP: every GPU holds every request's KV); requests of {args.request_tokens} "
        "tokens"
    )
    head = ("model", "weights", "model weights GiB", "--kv-cache-dtype", "KV B/token",
            "per layer kind (B/token)", "weights/GPU GiB", "cache room GiB",
            f"max {args.request_tokens // 1024}k requests", "cached tokens")  # fmt: skip
    cells = [
        (r.model, r.weights, f"{r.model_weights_gib:.0f}", r.kv, f"{r.bytes_per_token:.0f}",
         r.per_layer, f"{r.weights_gib:.1f}", f"{r.room_gib:.1f}",
         str(r.requests) if r.room_gib > 0 else "does not fit", r.tokens)
        for r in rows
    ]  # fmt: skip
    print(markdown_table(head, cells, align="llrlrl" + "r" * 4))


def _row(model: str, fmt: str, whole: float, gpus: int, kv: str, shape: MemoryModel,
         per_layer: str, gpu: float, args: argparse.Namespace, block: int) -> Row:  # fmt: skip
    gib = float(1 << 30)
    weights = whole / gpus
    room = gpu - weights
    n = (
        0
        if room <= 0
        else most_requests(shape, room, args.request_tokens, block, args.chunk, args.logit_rows)
    )
    tokens = n * blocks_for(args.request_tokens, block) * block
    return Row(model, fmt, whole / gib, kv, shape.bytes_per_cached_token(), per_layer,
               weights / gib, room / gib, n, tokens)  # fmt: skip


if __name__ == "__main__":
    main()
