"""Per-op GPU time of one decode layer under CUDA-graph replay, against the bytes each op must read.

Each op of the layer (the same calls the static decode makes, on the same tensors) is captured in
its own CUDA graph and replayed ``--replays`` times between two events; the whole layer is
captured once more as one graph. An op's roofline is the bytes it must read (weights, plus the
cache rows a live-length-aware kernel would touch: live window rows, visible indexer keys, the
selected compressed entries) over ``--bandwidth`` (4.2 TB/s, the H200's HBM3e). ``x roof`` is
measured time over that roofline; the layer row also shows the sum of its ops.

DeepSeek V4: the wide bench model's layer (hidden 4096, 256 experts top-6 + shared, 64 heads of
512, window 128, indexer 64x128 top-512), ratio 4 (with the indexer) and ratio 128, each request
at ``context - 1 - (i % 7)`` tokens in a slot pool filled with random rows.
Kimi K3: one KDA layer (96 heads of 128, the recurrent decode step) with the latent MoE (128 of
the 896 experts, top-16, so that it fits), one NoPE MLA layer (64 heads, latent 512 + 64, the
absorbed decode over a context of random latent rows in a paged store: the flash-decoding kernel
the model runs on the GPU, the batched torch pass it falls back to, and the old per-request loop;
the layer sum counts the kernel where it runs), the AttnRes reads over an 8-block bank.
Small caches stay in L2 across replays, so ops far under 1 MB read may look faster than HBM.

It turns SGLANG_DSV4_LENGTH_AWARE_DECODE on (the default) for its kernel rows;
--smoke runs tiny models on the CPU with the kernels under the Triton interpreter
(only to check that the script runs).

Usage: python scripts/profile_decode.py [--models dsv4,k3] [--batch 1,16,64]
       [--context 1024,8192,32768] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:  # before Triton loads: the kernels run in its interpreter on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang.kernels.ops.attention.absorbed_mla_decode import absorbed_decode_unsupported
from sglang.kernels.ops.attention.indexer_scores import indexer_scores
from sglang.kernels.ops.attention.indexer_topk import indexer_topk
from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.attention.dsv4_static_compressor import compress_decode_step
from sglang.srt.layers.attention.dsv4_static_decode import sink_attention, static_decode_attention
from sglang.srt.layers.attention.kda import KimiDeltaAttention, gated_rms_norm
from sglang.srt.layers.attention.kda_decode import (
    decode_rows,
    kernel_decode,
    kernel_decode_reason,
)
from sglang.srt.layers.attention.kda_gate import kda_beta, kda_forget_gate
from sglang.srt.layers.attention.mla_absorbed_batch import (
    PagedLatents,
    absorbed_decode,
    absorbed_decode_paged,
    decode_chunks,
    gather_paged,
)
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention
from sglang.srt.layers.attn_res import AttnResState, attn_res_score_vector
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.mhc import MhcParams
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.mem_cache.kimi_k3_cache import KDAState
from sglang.srt.mem_cache.paged_index import gather_slot_rows, row_address
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM, _hc_pre, _post_then_pre
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.utils.cuda_timing import graph_kernel_table, median_graph_replay_ms
from sglang.test.random_params import randomize_params_

GB = 1e9
PER_REQUEST_MLA = "MLA absorbed attention, per request"
KDA_STEP = "KDA conv + recurrent step"
OLD_KDA_STEP = "  old: torch step, stack + copy back"
BATCHED_MLA = "MLA absorbed attention, batched"
KERNEL_MLA = "MLA absorbed attention, kernel"
DEV = "cuda"
TINY: dict[str, Any] = {}  # --smoke: config overrides that make the models CPU-sized


@dataclass(frozen=True)
class OpRow:
    model: str
    case: str
    op: str
    ms: float
    bytes_read: float
    bandwidth: float

    @property
    def roof_ms(self) -> float:
        return self.bytes_read / self.bandwidth * 1e3

    def line(self) -> str:
        ratio = self.ms / self.roof_ms if self.roof_ms > 0 else float("nan")
        return (
            f"{self.model:<10} {self.case:<16} {self.op:<34} {self.ms * 1e3:>9.1f} "
            f"{self.bytes_read / 1e6:>10.2f} {self.roof_ms * 1e3:>9.1f} {ratio:>7.1f}"
        )


def graph_ms(fn: Callable[[], object], replays: int) -> float:
    """Median per-replay milliseconds of ``fn`` captured in one CUDA graph."""
    if DEV == "cpu":  # --smoke: eager, one run
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return median_graph_replay_ms(fn, replays)


def param_bytes(*modules: nn.Module | torch.Tensor | None) -> float:
    total = 0
    for m in modules:
        if m is None:
            continue
        tensors = [m] if isinstance(m, torch.Tensor) else [*m.parameters(), *m.buffers()]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return float(total)


def tensor_bytes(*ts: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def load_random_experts(experts: Any, gen: torch.Generator) -> float:
    """Random bf16 expert weights into a FusedMoE; returns the bytes of one expert."""
    c = experts.config
    w13 = torch.randn(
        c.num_experts, 2 * c.intermediate_size, c.hidden_size, generator=gen, device=DEV
    ).to(torch.bfloat16) * (c.hidden_size**-0.5)
    w2 = torch.randn(
        c.num_experts, c.hidden_size, c.intermediate_size, generator=gen, device=DEV
    ).to(torch.bfloat16) * (c.intermediate_size**-0.5)
    experts.load_weights(ExpertWeights(w13, w2))
    return float(3 * c.intermediate_size * c.hidden_size * 2)


def distinct_experts(num: int, top_k: int, bs: int) -> float:
    """Expected number of distinct experts ``bs`` tokens route to (uniform routing)."""
    return num * (1.0 - (1.0 - top_k / num) ** bs)


# --- DeepSeek V4 ------------------------------------------------------------------------------


def _spec() -> LayerBuildSpec:
    """bf16 on ``DEV``, the Triton MoE runner on CUDA."""
    return LayerBuildSpec(
        dtype=torch.bfloat16, device=DEV, moe_runner="triton" if DEV == "cuda" else "torch"
    )


def dsv4_config(ratio: int, max_pos: int) -> dict[str, Any]:
    from bench_dsv4_layer import LAYER  # the bench model's layer (scripts/ is on sys.path)

    cfg = {**LAYER, "compress_ratios": [ratio], "max_position_embeddings": max_pos}
    return {**cfg, **TINY.get("dsv4", {})}


@dataclass(frozen=True)
class Dsv4Layer:
    """The profiled DeepSeek V4 layer and what every case shares."""

    model: DeepseekV4ForCausalLM
    cfg: DeepseekV4ModelConfig
    mix: MhcParams
    expert_bytes: float


Op = tuple[str, Callable[[], object], float]  # (name, the op, bytes it must read)


def dsv4_rows(
    ratio: int,
    batches: list[int],
    contexts: list[int],
    replays: int,
    bw: float,
    tables: set[tuple[int, int]],
) -> list[OpRow]:
    cfg = DeepseekV4ModelConfig.from_dict(dsv4_config(ratio, max(contexts) + 64))
    model = DeepseekV4ForCausalLM(cfg, _spec())
    gen = torch.Generator(DEV).manual_seed(0)
    randomize_params_(model, gen, vector_scale=0.1)
    lay = Dsv4Layer(
        model, cfg, model.mhc, load_random_experts(model.decoder_layers[0].ffn.experts, gen)
    )
    rows: list[OpRow] = []
    name = f"dsv4 r{ratio}"
    for ctx in contexts:
        pool = model.enable_slot_pool(max(batches), ctx + 8)
        for slot in range(max(batches)):  # every slot holds the blocks of a ctx-token request
            pool.reserve(slot, ctx + 8)
        with torch.no_grad():
            for t in (pool.layers[0].window, *_compressor_tensors(pool.layers[0])):
                t.copy_(torch.randn(t.shape, generator=gen, device=DEV).to(t.dtype))
        for bs in batches:
            case = f"bs{bs} ctx{_ctx(ctx)}"
            ops, whole_layer = dsv4_ops(lay, bs, ctx, gen)
            op_rows = [OpRow(name, case, n, graph_ms(f, replays), b, bw) for n, f, b in ops]
            old = [r for r in op_rows if not r.op.startswith("  new")]
            total_b = sum(r.bytes_read for r in old)
            op_rows.append(
                OpRow(name, case, "= sum of the ops", sum(r.ms for r in old), total_b, bw)
            )
            before = graph_ms(torch_attention_layer(whole_layer), replays)
            op_rows.append(OpRow(name, case, "= layer graph, torch attention", before, total_b, bw))
            layer_ms = graph_ms(whole_layer, replays)
            if DEV == "cuda" and (bs, ctx) in tables:
                try:
                    print(graph_kernel_table(whole_layer, f"{name} {case}", top=24), flush=True)
                except (RuntimeError, AttributeError) as e:  # extra; never lose the run to it
                    print(f"kernel table failed: {e!r}")
            op_rows.append(OpRow(name, case, "= layer graph, kernels", layer_ms, total_b, bw))
            print("\n".join(r.line() for r in op_rows), flush=True)
            rows.extend(op_rows)
        model.slot_pool = None
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def dsv4_ops(
    lay: Dsv4Layer, bs: int, ctx: int, gen: torch.Generator
) -> tuple[list[Op], Callable[[], object]]:
    """The layer's decode ops for ``bs`` requests near ``ctx`` tokens, and the whole layer."""
    cfg, mix, model = lay.cfg, lay.mix, lay.model
    layer = model.decoder_layers[0]
    attn, moe = layer.attn, layer.ffn
    assert model.slot_pool is not None
    store = model.slot_pool.layers[0]
    table = model.slot_pool.blocks.table
    ratio, h, d = attn.ratio, cfg.hidden_size, cfg.head_dim
    ids = torch.randint(0, cfg.vocab_size, (bs,), generator=gen, device=DEV)
    positions = ctx - 1 - torch.arange(bs, device=DEV) % 7
    slots = torch.arange(bs, device=DEV)
    residual = torch.randn(bs, cfg.hc_mult, h, generator=gen, device=DEV).to(torch.bfloat16)
    x, post, comb = _hc_pre(residual, layer.hc_attn(mix))
    p = attn.project(x, positions)
    a_out = torch.randn(bs, h, generator=gen, device=DEV).to(torch.bfloat16)
    live_win = min(ctx, cfg.sliding_window)
    ring = store.window
    width = ring.shape[1]
    comp, comp_store = attn.compressor, store.compressor
    assert comp is not None and comp_store is not None
    visible = torch.div(positions + 1, ratio, rounding_mode="floor")
    n_vis = (ctx // ratio) * bs

    def mhc() -> None:
        _post_then_pre(a_out, residual, post, comb, layer.hc_ffn(mix))
        _post_then_pre(a_out, residual, post, comb, layer.hc_attn(mix))

    def ring_write() -> None:
        ring[slots, positions % width] = p.kv.to(ring.dtype)

    def compress() -> None:
        compress_decode_step(
            comp, comp_store, *comp.project(x), positions, slots, table, attn.rotary
        )

    def window_keys() -> tuple[torch.Tensor, torch.Tensor]:
        rws = torch.arange(width, device=DEV)
        wp = positions[:, None] - (positions[:, None] - rws[None, :]) % width
        return ring[slots], wp >= 0

    pend = tensor_bytes(comp_store.pending_kv[0], comp_store.pending_score[0])
    ops: list[Op] = [
        ("mHC post+pre x2", mhc, 2 * tensor_bytes(residual, a_out, layer.hc_attn_fn, residual, x)),
        (
            "q/kv proj + norms + rope",
            lambda: attn.project(x, positions),
            param_bytes(attn.wq_a, attn.q_norm, attn.wq_b, attn.wkv, attn.kv_norm),
        ),
        ("window ring write", ring_write, bs * d * 2.0),
        ("compressor proj + update", compress, param_bytes(comp) + bs * pend),
    ]
    if attn.indexer is None:

        def attend() -> torch.Tensor:
            entries = gather_slot_rows(comp_store.entries, table, slots)
            ent = torch.arange(entries.shape[1], device=DEV)
            wk, wv = window_keys()
            keys = torch.cat([wk, entries], 1)
            valid = torch.cat([wv, ent[None, :] < visible[:, None]], 1)
            return sink_attention(p.q, keys, valid, attn.attn_sink, attn.scale)

        att_bytes = (live_win * bs + n_vis) * d * 2.0 + tensor_bytes(p.q)
    else:
        idx, idx_store = attn.indexer, store.indexer
        assert idx_store is not None
        ic = idx.compressor

        def idx_compress() -> None:
            compress_decode_step(
                ic, idx_store, *ic.project(x), positions, slots, table, attn.rotary
            )

        iq, iw = idx.queries(p.q_lora, x, p.cos, p.sin)
        ipend = tensor_bytes(idx_store.pending_kv[0], idx_store.pending_score[0])
        ops += [
            ("indexer compressor proj + update", idx_compress, param_bytes(ic) + bs * ipend),
            (
                "indexer queries",
                lambda: idx.queries(p.q_lora, x, p.cos, p.sin),
                param_bytes(idx.wq_b, idx.weights_proj),
            ),
            (
                "indexer scores + top-k",
                lambda: idx.top_entries(
                    iq, iw, gather_slot_rows(idx_store.entries, table, slots), visible
                ),
                n_vis * cfg.index_head_dim * 2.0,
            ),
        ]
        idx_keys = gather_slot_rows(idx_store.entries, table, slots)
        top, ok = idx.top_entries(iq, iw, idx_keys, visible)
        k = min(cfg.index_topk, idx_keys.shape[1])

        def scores_kernel() -> torch.Tensor:
            # The kernel reads the paged keys in place, through the block table.
            return indexer_scores(
                iq, iw, idx_store.entries, slots, visible, idx.head_dim**-0.5, table=table
            )

        def kernel_scores() -> torch.Tensor:  # what the static decode runs by default
            sc = scores_kernel()
            return torch.sort(sc, dim=-1, descending=True, stable=True).indices[:, :k]

        def kernel_scores_topk() -> torch.Tensor:  # with SGLANG_DSV4_TOPK_KERNEL=1
            return indexer_topk(scores_kernel(), visible, k)

        picks = kernel_scores()
        ops.append(("  new: indexer scores kernel + sort", kernel_scores, ops[-1][2]))
        ops.append(("  new: indexer scores + top-k kernels", kernel_scores_topk, ops[-1][2]))

        def attend() -> torch.Tensor:
            wk, wv = window_keys()
            # only the picked entries, through the table, as the static decode reads them
            block, offset = row_address(table, slots[:, None], top, comp_store.entries.shape[1])
            keys = torch.cat([wk, comp_store.entries[block, offset]], 1)
            valid = torch.cat([wv, ok.gather(1, top)], 1)
            return sink_attention(p.q, keys, valid, attn.attn_sink, attn.scale)

        sel = min(cfg.index_topk, ctx // ratio)
        att_bytes = (live_win + sel) * bs * d * 2.0 + tensor_bytes(p.q)

    def kernel_attend() -> torch.Tensor:
        extra: dict[str, Any] = {"entries": comp_store.entries, "ratio": ratio, "table": table}
        if attn.indexer is not None:
            extra["picks"] = picks
        return sparse_decode_attention(
            p.q, ring, slots, positions, attn.attn_sink, attn.scale, **extra
        )

    o = attend()
    experts = distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, bs)
    ops += [
        ("attention (window+entries+sink)", attend, att_bytes),
        ("  new: sparse attention kernel", kernel_attend, att_bytes),
        (
            "output: inv rope, wo_a, wo_b",
            lambda: attn.output(o, p, torch.bfloat16),
            param_bytes(attn.wo_a, attn.wo_b),
        ),
        (
            "MoE (router, experts, shared)",
            lambda: moe(x, ids),
            param_bytes(moe.gate, moe.shared_experts) + lay.expert_bytes * experts,
        ),
    ]

    def whole_layer() -> None:
        a = static_decode_attention(attn, x, positions, slots, store, table)
        r, y, po, co = _post_then_pre(a, residual, post, comb, layer.hc_ffn(mix))
        _post_then_pre(moe(y, ids), r, po, co, layer.hc_attn(mix))

    return ops, whole_layer


def torch_attention_layer(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the static decode's torch attention path (the layer before the kernels)."""

    def run() -> object:
        real = dsv4_static_decode.use_sparse_kernels
        dsv4_static_decode.use_sparse_kernels = lambda *a: False  # type: ignore[assignment]
        try:
            return fn()
        finally:
            dsv4_static_decode.use_sparse_kernels = real

    return run


def _ctx(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def _compressor_tensors(store: Any) -> list[torch.Tensor]:
    out = []
    for comp in (store.compressor, store.indexer):
        if comp is None:
            continue
        out += [comp.entries, comp.pending_kv, comp.pending_score]
        out += [t for t in (comp.prev_kv, comp.prev_score) if t is not None]
    return out


# --- Kimi K3 ----------------------------------------------------------------------------------


def k3_config(experts: int) -> dict[str, Any]:
    from bench_kimi_k3_layers import k3_config as bench_config

    cfg = bench_config(experts)
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], "kda_layers": [1]}
    cfg["linear_attn_config"]["full_attn_layers"] = [2]
    cfg["attn_res_block_size"] = 2  # AttnRes on, so its reads are profiled
    tiny = TINY.get("k3", {})
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], **tiny.pop("linear", {})}
    return {**cfg, **tiny}


def k3_rows(
    batches: list[int], contexts: list[int], replays: int, bw: float, experts: int
) -> list[OpRow]:
    cfg = KimiK3Config.from_dict(k3_config(experts))
    model = KimiK3ForCausalLM(cfg, _spec())
    gen = torch.Generator(DEV).manual_seed(0)
    randomize_params_(model, gen, vector_scale=0.1)
    moe = model.decoder_layers[1].mlp
    assert isinstance(moe, KimiK3MoE)
    expert_bytes = load_random_experts(moe.experts, gen)
    rows: list[OpRow] = []
    for bs in batches:
        x = (torch.randn(bs, cfg.hidden_size, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
        ops = k3_kda_ops(model, x, gen)
        moe_bytes = param_bytes(moe) + expert_bytes * distinct_experts(
            cfg.num_experts, cfg.num_experts_per_token, bs
        )
        ops.append(("latent MoE", _bind(moe, x), moe_bytes))
        ops.append(k3_attn_res_op(model, x, gen))
        all_rows = [OpRow("k3 kda", f"bs{bs}", n, graph_ms(f, replays), b, bw) for n, f, b in ops]
        old = next(r for r in all_rows if r.op == OLD_KDA_STEP)
        k_rows = [r for r in all_rows if r is not old]
        rows += all_rows
        # A layer: its attention, the MoE and two AttnRes reads; once more with the old step.
        before = [old if r.op.startswith(KDA_STEP) else r for r in k_rows]
        layer_rows = [
            _k3_layer_row("k3 kda", f"bs{bs}", k_rows, bw),
            _k3_layer_row("k3 kda", f"bs{bs}", before, bw, "  old: = layer, torch step"),
        ]
        rows += layer_rows
        for ctx in contexts:
            case = f"bs{bs} ctx{_ctx(ctx)}"
            m_rows = [
                OpRow("k3 mla", case, n, graph_ms(f, replays), b, bw)
                for n, f, b in k3_mla_ops(model, x, ctx, gen)
            ]
            rows += m_rows
            # The model runs the kernel where it can (else the batched torch pass); the
            # per-request row is the old path.
            ran = KERNEL_MLA if any(r.op == KERNEL_MLA for r in m_rows) else BATCHED_MLA
            skip = {PER_REQUEST_MLA, BATCHED_MLA, KERNEL_MLA} - {ran}
            layer_ops = [r for r in m_rows if r.op not in skip]
            rows.append(_k3_layer_row("k3 mla", case, [*layer_ops, *k_rows[-2:]], bw))
            rows.append(k3_static_decode_row(model, bs, ctx, replays, bw, rows[-1], layer_rows[0]))
            print("\n".join(r.line() for r in m_rows + rows[-2:]), flush=True)
        print("\n".join(r.line() for r in all_rows + layer_rows), flush=True)
    return rows


@torch.no_grad()
def k3_static_decode_row(
    model: KimiK3ForCausalLM,
    bs: int,
    ctx: int,
    replays: int,
    bw: float,
    mla_layer: OpRow,
    kda_layer: OpRow,
) -> OpRow:
    """The whole model's static decode (its KDA layer, its MLA layer, the embedding and head)
    captured in one graph, as K3 serves with ``SGLANG_K3_STATIC_DECODE`` on; its floor is the
    two layer rows' bytes."""
    pool = model.enable_slot_pool(bs, ctx + 8)
    gen = torch.Generator(DEV).manual_seed(1)
    for store in (t for t in pool.latents if t is not None):
        store.copy_(torch.randn(store.shape, generator=gen, device=DEV).to(store.dtype))
    slots = torch.tensor([pool.alloc() for _ in range(bs)], device=DEV)
    for slot in slots.tolist():
        pool.reserve(slot, ctx + 8)
    positions = torch.tensor([ctx - 1 - (i % 7) for i in range(bs)], device=DEV)
    ids = torch.randint(0, model.config.vocab_size, (bs,), generator=gen, device=DEV)
    ms = graph_ms(lambda: model.static_decode(ids, positions, slots), replays)
    model.slot_pool = None
    case = f"bs{bs} ctx{_ctx(ctx)}"
    read = mla_layer.bytes_read + kda_layer.bytes_read
    return OpRow("k3 model", case, "= model static decode graph", ms, read, bw)


def _bind(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> Callable[[], object]:
    return lambda: fn(x)


def _k3_layer_row(
    model: str, case: str, parts: list[OpRow], bw: float, op: str = "= layer (sum, 2 AttnRes reads)"
) -> OpRow:
    """Sum of a K3 layer's ops, the AttnRes read (the last part) counted twice."""
    ms = sum(r.ms for r in parts) + parts[-1].ms
    read = sum(r.bytes_read for r in parts) + parts[-1].bytes_read
    return OpRow(model, case, op, ms, read, bw)


@torch.no_grad()
def k3_kda_ops(model: KimiK3ForCausalLM, x: torch.Tensor, gen: torch.Generator) -> list[Op]:
    """One KDA layer's decode ops. The conv + recurrent step is the model's decode path on
    per-request states (the kernels on a GPU, updating them in place through their address
    table); the torch path it replaced (stack the states, step, copy each back) is a reference row
    outside the layer sum."""
    kda = model.decoder_layers[0].self_attn
    assert isinstance(kda, KimiDeltaAttention)
    kc = kda.config
    bs, heads, dh = x.shape[0], kda.local_heads, kc.head_dim
    states = [
        KDAState(
            torch.randn(kc.conv_size - 1, 3 * heads * dh, generator=gen, device=DEV).to(x.dtype),
            torch.randn(heads, dh, dh, generator=gen, device=DEV) * 0.1,
        )
        for _ in range(bs)
    ]
    weight = kda.conv_weight()

    def kda_proj() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed = torch.cat([kda.q_proj(x), kda.k_proj(x), kda.v_proj(x)], dim=-1)
        gate_in = kda.f_b_proj(kda.f_a_proj(x)).float() + kda.dt_bias
        g = kda_forget_gate(gate_in.view(bs, heads, dh), kda.A_log, kc.gate_lower_bound)
        return mixed, g, kda_beta(kda.b_proj(x))

    mixed, g, beta = kda_proj()
    core = torch.zeros(bs, heads, dh, device=DEV)
    rows = torch.arange(bs, device=DEV)
    # The table is built outside the graph, as the model builds it before the launches.
    table = decode_rows(range(bs), states, torch.device(DEV))
    why = kernel_decode_reason(mixed, weight, states, heads, dh)

    def kda_step() -> None:
        if why is None:
            kernel_decode(mixed, g, beta, table, weight, core, dh)
        else:
            kda.torch_decode(mixed, g, beta, rows, states, weight, core)

    def kda_step_torch() -> None:
        kda.torch_decode(mixed, g, beta, rows, states, weight, core)

    kda_step()

    def kda_out() -> torch.Tensor:
        gate = kda.output_gate(x).view(bs, heads, dh)
        out = gated_rms_norm(core.to(x.dtype), kda.o_norm.weight, gate, kc.o_norm_eps)
        return kda.o_proj(out.reshape(bs, heads * dh))

    proj = (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_a_proj, kda.f_b_proj, kda.b_proj)
    gates = (kda.g_proj, kda.g_a_proj, kda.g_b_proj, kda.o_norm, kda.o_proj)
    step_bytes = 2 * bs * tensor_bytes(states[0].recurrent, states[0].conv) + param_bytes(weight)
    return [
        ("KDA q/k/v/gate/beta proj", kda_proj, param_bytes(*proj)),
        (KDA_STEP if why is None else f"{KDA_STEP} (torch)", kda_step, step_bytes),
        (OLD_KDA_STEP, kda_step_torch, step_bytes),
        ("KDA out gate + norm + o_proj", kda_out, param_bytes(*gates)),
    ]


@torch.no_grad()
def k3_attn_res_op(model: KimiK3ForCausalLM, x: torch.Tensor, gen: torch.Generator) -> Op:
    layer = model.decoder_layers[1]
    score = attn_res_score_vector(layer.self_attention_res_norm, layer.self_attention_res_proj)
    bank = [torch.randn(x.shape, generator=gen, device=DEV).to(x.dtype) for _ in range(8)]
    eps = model.config.rms_norm_eps

    def res_read() -> torch.Tensor:
        st = AttnResState(x)
        st.bank = list(bank)
        return st.read(score, eps, layer.input_layernorm)

    return ("AttnRes read (8-block bank)", res_read, 9 * tensor_bytes(x))


@torch.no_grad()
def k3_mla_ops(
    model: KimiK3ForCausalLM, x: torch.Tensor, ctx: int, gen: torch.Generator
) -> list[Op]:
    """One NoPE MLA layer's decode ops; the absorbed attention by the kernel (as the model runs it
    on paged bf16 latents on the GPU), by the batched torch pass (its fallback) and per request
    (the path those replaced); only the one the model runs is in the layer sum."""
    mla = model.decoder_layers[1].self_attn
    assert isinstance(mla, MLANoPEAttention)
    mc = mla.config
    bs = x.shape[0]
    lat = mc.kv_lora_rank + mc.qk_rope_head_dim
    kv = (torch.randn(bs, ctx, lat, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
    q = mla.queries(x)
    o = torch.randn(bs, mla.local_heads * mc.v_head_dim, generator=gen, device=DEV).to(x.dtype)

    def absorbed() -> list[torch.Tensor]:
        wk, wv = (w.float() for w in mla._kv_b_per_head())
        return [mla._attend_absorbed(q[i : i + 1], kv[i], wk, wv) for i in range(bs)]

    # The batched path as the model runs it on paged latents: the same rows in a block store
    # (blocks of 256 and a null block), gathered through the block table in groups of at most
    # ``max_padded_rows`` padded rows. Tables, lengths and row indices are made outside the graph.
    per_block = 256
    nb = -(-ctx // per_block)
    store = torch.zeros(bs * nb + 1, per_block, lat, dtype=kv.dtype, device=DEV)
    store[:-1].view(bs, nb * per_block, lat)[:, :ctx] = kv
    table = torch.arange(bs * nb, device=DEV).view(bs, nb)
    lengths = torch.full((bs,), ctx, dtype=torch.long, device=DEV)
    groups = [
        torch.tensor(g, dtype=torch.long, device=DEV)
        for g in decode_chunks([ctx] * bs, mla.max_padded_rows)
    ]

    def absorbed_batched() -> list[torch.Tensor]:
        wk, wv = (w.float() for w in mla._kv_b_per_head())
        outs = []
        for g in groups:
            lat_rows = gather_paged(store, table[g], lengths[g], ctx)
            outs.append(
                absorbed_decode(
                    q[g],
                    lat_rows,
                    lengths[g],
                    wk,
                    wv,
                    rope_dim=mc.qk_rope_head_dim,
                    scale=mla.scale,
                )
            )
        return outs

    latents = PagedLatents(store, table, lengths, ctx)
    kernel_ok = triton_can_run(store) and (
        absorbed_decode_unsupported(mc.kv_lora_rank, mc.qk_rope_head_dim, store.dtype) is None
    )

    def absorbed_kernel() -> torch.Tensor:
        wk, wv = (w.float() for w in mla._kv_b_per_head())
        return absorbed_decode_paged(
            q, latents, wk, wv, rope_dim=mc.qk_rope_head_dim, scale=mla.scale
        )

    def mla_out() -> torch.Tensor:
        gate = mla.g_proj
        return mla.o_proj(o * torch.sigmoid(gate(x).float()).to(o.dtype) if gate else o)

    q_mods = (mla.q_proj, mla.q_a_proj, mla.q_a_layernorm, mla.q_b_proj)
    kv_mods = (mla.kv_a_proj_with_mqa, mla.kv_a_layernorm)
    attn_bytes = tensor_bytes(kv) + param_bytes(mla.kv_b_proj)
    kernel = [(KERNEL_MLA, absorbed_kernel, attn_bytes)] if kernel_ok else []
    return [
        (
            "MLA q + latent proj",
            lambda: (mla.queries(x), mla.latents(x)),
            param_bytes(*q_mods, *kv_mods),
        ),
        (PER_REQUEST_MLA, absorbed, attn_bytes),
        (BATCHED_MLA, absorbed_batched, attn_bytes),
        *kernel,
        ("MLA out gate + o_proj", mla_out, param_bytes(mla.g_proj, mla.o_proj)),
    ]


def header() -> str:
    return (
        f"{'model':<10} {'case':<16} {'op':<34} {'us':>9} {'MB read':>10} {'roof us':>9} "
        f"{'x roof':>7}"
    )


def main() -> None:
    os.environ.setdefault("SGLANG_DSV4_LENGTH_AWARE_DECODE", "1")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="dsv4,k3")
    parser.add_argument("--ratios", default="4,128")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--context", default="1024,8192,32768")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s")
    parser.add_argument("--k3-experts", type=int, default=128)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--kernel-tables",
        default="1:8192,16:8192",
        help="bs:ctx cases whose DSv4 layer graph gets a per-kernel table",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, eager")
    args = parser.parse_args()
    if args.smoke:
        global DEV
        DEV = "cpu"
        TINY["dsv4"] = {
            "hidden_size": 256,
            "num_attention_heads": 8,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 64,
            "o_groups": 2,
            "o_lora_rank": 64,
            "n_routed_experts": 8,
            "moe_intermediate_size": 64,
            "index_n_heads": 4,
            "index_head_dim": 32,
            "index_topk": 16,
            "sliding_window": 16,
        }
        TINY["k3"] = {
            "hidden_size": 256,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "moe_intermediate_size": 64,
            "routed_expert_hidden_size": 128,
            "num_experts_per_token": 2,
            "linear": {"num_heads": 4, "head_dim": 16},
        }
    batches = [int(b) for b in args.batch.split(",")]
    tables = {
        (int(b), int(c)) for b, c in (t.split(":") for t in args.kernel_tables.split(",") if t)
    }
    contexts = [int(c) for c in args.context.split(",")]
    rows: list[OpRow] = []
    print(header(), flush=True)
    models = args.models.split(",")
    if "dsv4" in models:
        for ratio in (int(r) for r in args.ratios.split(",")):
            rows += dsv4_rows(ratio, batches, contexts, args.replays, args.bandwidth, tables)
    if "k3" in models:
        rows += k3_rows(batches, contexts, args.replays, args.bandwidth, args.k3_experts)
    print("\n" + header())
    for r in rows:
        print(r.line())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "roof_ms": r.roof_ms} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
