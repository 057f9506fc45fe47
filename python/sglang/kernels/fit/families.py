"""Every kernel family the engine may launch, where its code lives, which function decides whether
it runs for a call, and what runs instead.

A family is the unit that is chosen or not: its decision function returns None (it runs) or the
reason it does not (dtype, shape, the device's limits, or the family turned off after a build
failure, ``switch.py``), and its caller then takes ``fallback``. ``modules`` are the modules whose
frames on a failure's stack name the family (``switch.failed_family``); every module of
``sglang.kernels.ops`` with a ``@triton.jit`` kernel belongs to exactly one family, or is one of
the :data:`INLINED_HELPERS` several families' kernels inline (checked by
``test/registered/kernels/test_kernel_fit.py``). Decisions are named as ``module:function`` so
this inventory imports nothing (several live in ``srt/``, which kernels never import).
"""

from __future__ import annotations

from dataclasses import dataclass

_OPS = "sglang.kernels.ops"
_ATTN = "sglang.srt.layers.attention"


@dataclass(frozen=True)
class KernelFamily:
    name: str
    modules: tuple[str, ...]
    decision: str  # "module:function"
    fallback: str


FAMILIES: tuple[KernelFamily, ...] = (
    KernelFamily(
        "fused_moe",
        (
            f"{_OPS}.moe.fused_moe",
            f"{_OPS}.moe.align",
            f"{_OPS}.moe.two_launch_config",
            f"{_OPS}.moe.tuned_configs",
        ),
        f"{_OPS}.moe.fused_moe:fused_moe_unfit_reason",
        "the torch experts (fused_experts_torch)",
    ),
    KernelFamily(
        "fused_moe_tma",
        (f"{_OPS}.moe.grouped_gemm_tma", f"{_OPS}.moe.fused_moe_tma", f"{_OPS}.moe.sorted_rows"),
        f"{_OPS}.moe.grouped_gemm_tma:tma_unfit_reason",
        "the two-launch fused MoE",
    ),
    KernelFamily(
        "moe_gather_combine",
        (f"{_OPS}.moe.gather_combine",),
        f"{_OPS}.moe.gather_combine:gather_combine_unfit_reason",
        "the torch gather and sum",
    ),
    KernelFamily(
        "mega_moe_triton",
        (
            f"{_OPS}.moe.mega_moe_triton",
            f"{_OPS}.moe.mega_moe_workspace",
            f"{_OPS}.gpu_clock",
            "sglang.srt.layers.moe.mega_moe_triton_backend",
        ),
        "sglang.srt.layers.moe.mega_moe_triton_backend:triton_mega_unavailable_reason",
        "the normal MoE path (dispatch, runner, combine)",
    ),
    KernelFamily(
        "deep_gemm",
        ("sglang.srt.layers.deep_gemm_adapter", "sglang.srt.layers.moe.moe_runner.deep_gemm"),
        "sglang.srt.layers.moe.moe_runner.deep_gemm:deep_gemm_unfit_reason",
        "the Triton fused MoE",
    ),
    KernelFamily(
        "deep_gemm_mega",
        ("sglang.srt.layers.moe.mega_moe",),
        "sglang.srt.layers.moe.mega_moe:mega_moe_layer_reason",
        "our Triton MegaMoE, else the normal MoE path",
    ),
    KernelFamily(
        "mhc_triton",
        (
            f"{_OPS}.layernorm.mhc_triton",
            f"{_OPS}.layernorm.mhc_mix_mma",
            f"{_OPS}.layernorm.mhc_post_stream",
            f"{_OPS}.layernorm.mhc_sinkhorn_scalar",
            f"{_OPS}.interp_dot",
        ),
        f"{_OPS}.layernorm.mhc_triton:mhc_triton_unfit_reason",
        "the torch mHC",
    ),
    KernelFamily(
        "mhc_tilelang",
        (f"{_OPS}.layernorm.mhc_tilelang",),
        f"{_OPS}.layernorm.mhc_tilelang:mhc_tilelang_unfit_reason",
        "the torch mHC",
    ),
    KernelFamily(
        "sparse_prefill_attention",
        (f"{_OPS}.attention.sparse_prefill_attention",),
        f"{_ATTN}.dsv4_core:prefill_kernel_reason",
        "the torch sparse attention",
    ),
    KernelFamily(
        "sparse_decode_attention",
        (f"{_OPS}.attention.sparse_decode_attention",),
        f"{_ATTN}.dsv4_static_decode:sparse_kernels_reason",
        "the torch sink attention",
    ),
    KernelFamily(
        "indexer",
        (f"{_OPS}.attention.indexer_scores", f"{_OPS}.attention.indexer_topk"),
        f"{_ATTN}.dsv4_indexer:scores_kernel_reason",
        "the torch scores and sort",
    ),
    KernelFamily(
        "compressor",
        (
            f"{_OPS}.attention.compressor_decode",
            f"{_OPS}.attention.compressor_prefill",
            f"{_OPS}.attention.compressor_entry",
        ),
        f"{_OPS}.attention.compressor_entry:compressor_unfit_reason",
        "the torch compressor",
    ),
    KernelFamily(
        "norm_rope",
        (f"{_OPS}.attention.norm_rope",),
        f"{_OPS}.attention.norm_rope:norm_rope_unfit_reason",
        "the torch norm, RoPE and cast",
    ),
    KernelFamily(
        "rope_cos_sin",
        (f"{_OPS}.attention.rope_cos_sin",),
        f"{_OPS}.attention.rope_cos_sin:rope_cos_sin_unfit_reason",
        "the torch cos/sin",
    ),
    KernelFamily(
        "absorbed_mla_decode",
        (f"{_OPS}.attention.absorbed_mla_decode",),
        f"{_OPS}.attention.absorbed_mla_decode:absorbed_decode_unfit_reason",
        "the torch absorbed decode",
    ),
    KernelFamily(
        "kda",
        (
            f"{_OPS}.kda.chunk_prefill",
            f"{_OPS}.kda.recurrent_step",
            f"{_OPS}.kda.conv_prefill",
            f"{_OPS}.kda.conv_decode",
        ),
        f"{_ATTN}.kda_prefill:prefill_kernel_reason",
        "the chunked / recurrent torch KDA",
    ),
    KernelFamily(
        "attn_res_read",
        (f"{_OPS}.layernorm.attn_res_read",),
        f"{_OPS}.layernorm.attn_res_read:attn_res_read_unfit_reason",
        "the torch AttnRes read",
    ),
    KernelFamily(
        "activation",
        (f"{_OPS}.activation",),
        f"{_OPS}.activation:act_and_mul_unfit_reason",
        "the torch gated activation",
    ),
    KernelFamily(
        "fp8_quant",
        (f"{_OPS}.quant.fp8",),
        f"{_OPS}.quant.fp8:quant_fp8_unfit_reason",
        "the torch quantiser",
    ),
    # Kernels whose configurations fit themselves to the device already (their own shared-memory
    # estimate): the families name their modules, so a build failure still names the family.
    KernelFamily(
        "fp8_block_gemm",
        (f"{_OPS}.gemm.fp8_block_gemm", f"{_OPS}.gemm.fp8_gemm_config"),
        f"{_OPS}.gemm.fp8_gemm_config:fit_to_shared",
        "the torch FP8 block GEMM",
    ),
    KernelFamily(
        "fused_moe_mxfp4",
        (
            f"{_OPS}.moe.fused_moe_mxfp4",
            f"{_OPS}.moe.mxfp4_operand",
            f"{_OPS}.moe.mxfp4_split_gemm",
            f"{_OPS}.moe.mxfp4_split_operand",
            f"{_OPS}.moe.mxfp4_config",
        ),
        f"{_OPS}.moe.mxfp4_config:mxfp4_config_fits",
        "the MXFP4 experts dequantised for the bf16 fused MoE",
    ),
    KernelFamily(
        "fp8_rows",
        (f"{_OPS}.quant.fp8_rows", f"{_OPS}.quant.fp8_row_write", f"{_OPS}.quant.fused_quant"),
        f"{_OPS}.quant.fp8_rows:fp8_rows_reason",
        "the torch FP8 row quantisers",
    ),
    KernelFamily(
        "grid_barrier",
        (f"{_OPS}.grid_barrier",),
        f"{_OPS}.grid_barrier:grid_barrier_unfit_reason",
        "none: the reserved-SM checks and benchmarks only (never served)",
    ),
)


def family(name: str) -> KernelFamily:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"unknown kernel family {name!r}")


# Modules of ``@triton.jit`` helpers that kernels of several families inline. They launch nothing
# themselves, so no decision is theirs and no failure's stack runs through them (a failure to
# build an inlining kernel names that kernel's family).
INLINED_HELPERS: tuple[str, ...] = (
    f"{_OPS}.attention.online_softmax",
    f"{_OPS}.quant.dtype_round",
    f"{_OPS}.tile_order",
)
