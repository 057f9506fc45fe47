"""Where the length-aware DSv4 decode kernels and the torch path part ways, on CPU or GPU.

The reused-slot case of ``test_deepseek_v4_cuda_graph_gpu.py``, run eagerly (no graphs): the
built-in model (bf16 by default), random weights (seed 7), a paged pool with blocks of 128
tokens: a request prefilled to 260 tokens and decoded to 300 (padded to 2 rows) is freed; its
slot is reused from a 3-token prompt and decoded to 30 tokens. Prints each step's mean relative
logit error against the eager reference decode on a per-request cache (the test's bound: 0.05)
and, with ``--per-layer``, each layer's largest difference between the kernel attention and the
torch path on the same pool state (the torch path runs first on a snapshot of the indexer's
compressor state, which is then restored), with the largest attention logit it saw. With
``--routing`` it runs the case twice (kernels, then the torch path) and prints the steps where
some MoE layer picked other experts for the request's row, with that router's gap between its
k-th and (k+1)-th expert scores (a flip at a near-tie is a discontinuity, not a kernel error).
With ``--matrix`` it runs the graph test's batch case instead (prompts of 5/100/230/20/61/7
tokens, 40 teacher-forced steps, ``--batch`` requests, the triton MoE runner) once per on/off
combination of the sparse attention kernels and the fused compressor step, with the reference
following the static path's routing at near-ties (``RouteFollower``) or not, and prints each
one's median, worst and over-bound step errors: which kernel moves the drift, and how much of it
router flips explain.

On the CPU the kernels run under the Triton interpreter, whose bf16 ``tl.dot`` is unusable, so
there they get fp32 copies of their inputs (and a torch-path run turns the interpreter off, so
no other Triton kernel runs in it either); on CUDA they get what the model passes.

    PYTHONPATH=python python scripts/dsv4_kernel_path_diff.py --device cuda --per-layer
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import torch

from sglang.kernels.ops.attention import indexer_scores as scores_mod
from sglang.kernels.ops.attention import sparse_decode_attention as attention_mod
from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.topk import compute_scores
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models import deepseek_v4_moe
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.decode_drift import RouteFollower, mean_rel

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


def _indexer_tensors(store: Any) -> list[torch.Tensor]:
    comp = store.indexer
    if comp is None:
        return []
    return [
        t
        for t in (comp.entries, comp.pending_kv, comp.pending_score, comp.prev_kv, comp.prev_score)
        if t is not None
    ]


def _compare_layers(log: list[tuple[int, float, float]]) -> None:
    """Each kernel attention call also runs the torch path on the same state; log (layer,
    largest relative difference of row 0, largest |logit|)."""
    kernel, torch_path = dsv4_static_decode._kernel_attention, dsv4_static_decode._torch_attention

    def both(attn: Any, x: Any, p: Any, positions: Any, slots: Any, store: Any, table: Any) -> Any:
        saved = [t.clone() for t in _indexer_tensors(store)]
        want = torch_path(attn, x, p, positions, slots, store, table)
        for t, s in zip(_indexer_tensors(store), saved):
            t.copy_(s)
        got = kernel(attn, x, p, positions, slots, store, table)
        diff = float((got[0] - want[0]).abs().max() / want[0].abs().max().clamp_min(1e-30))
        ring = store.window[slots[0]].float()
        logit = float((p.q[0].float() @ ring.t()).abs().max() * attn.scale)
        log.append((attn.layer_id, diff, logit))
        return got

    dsv4_static_decode._kernel_attention = both  # type: ignore[assignment]


def _ids(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).to(device)


Route = tuple[int, list[int], float]  # (call index in the step, experts of row 0, k/k+1 gap)


def _record_routing(routes: list[Route]) -> None:
    real = deepseek_v4_moe.select_experts

    def spy(logits: torch.Tensor, config: Any, bias: Any = None) -> Any:
        out = real(logits, config, bias)
        scores = compute_scores(logits[:1].float(), config.scoring_func)[0]
        if bias is not None:
            scores = scores + bias.float()
        ranked = scores.sort(descending=True).values
        k = out.topk_ids.shape[-1]
        gap = float(ranked[k - 1] - ranked[k]) if ranked.numel() > k else float("inf")
        routes.append((len(routes), sorted(out.topk_ids[0].tolist()), gap))
        return out

    deepseek_v4_moe.select_experts = spy  # type: ignore[assignment]


def run_case(
    dev: str,
    dtype: str,
    use_kernels: bool,
    log: list[tuple[int, float, float]],
    routes: list[Route],
) -> tuple[list[float], list[list[Route]]]:
    """The reused-slot case; per step its mean relative logit error and its routing."""
    dsv4_static_decode.use_sparse_kernels = lambda *a: use_kernels  # type: ignore[assignment]
    if dev == "cpu":  # the torch path everywhere: no other Triton kernel under the interpreter
        os.environ["TRITON_INTERPRET"] = "1" if use_kernels else "0"
    raw = default_model_config(VOCAB, 0, 1)
    spec = LayerBuildSpec(dtype=getattr(torch, dtype), device=dev, moe_runner="torch")
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(raw), spec)
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=18, capacity=512, block_tokens=128)
    errs: list[float] = []
    per_step: list[list[Route]] = []
    with torch.no_grad():
        first, seq = model.new_pooled_cache(), _ids(300, 1, dev)
        model.prefill(seq[:260], first)
        for t in range(260, 300):
            model.decode_pooled(seq[t : t + 1], [first], pad_to=2)
        model.free_pooled_cache(first)
        log.clear()
        reused, fresh, short = model.new_pooled_cache(), model.new_request_cache(), _ids(30, 2, dev)
        model.prefill(short[:3], reused)
        model.prefill(short[:3], fresh)
        for t in range(3, 30):
            routes.clear()
            got = model.decode_pooled(short[t : t + 1], [reused], pad_to=2)
            per_step.append(list(routes))
            errs.append(mean_rel(got, model.decode(short[t : t + 1], [fresh])))
            if log:
                worst = max(log, key=lambda r: r[1])
                print(
                    f"step {t}: logits err {errs[-1]:.4f}; kernel vs torch per layer: "
                    + " ".join(f"L{i}:{d:.1e}" for i, d, _ in log)
                    + f"; worst L{worst[0]} max|logit| {worst[2]:.1f}"
                )
                log.clear()
    head = f"{'kernels' if use_kernels else 'torch'}, {dtype}, {dev}"
    print(f"{head}: worst mean relative error {max(errs):.4f} (bound 0.05)")
    print("per step: " + " ".join(f"{e:.4f}" for e in errs))
    return errs, per_step


LENGTHS = (5, 100, 230, 20, 61, 7)
STEPS = 40


def run_batch_case(
    dev: str, dtype: str, bs: int, sparse: bool, compressor: bool, follow: bool
) -> tuple[list[float], list[float]]:
    """The graph test's batch case, eager static decode against the per-request reference (which
    follows the static path's routing at near-ties where ``follow``); the step errors and the
    followed flips' router gaps."""
    from sglang.srt.layers.attention import dsv4_static_compressor

    real_use = dsv4_static_compressor.__dict__.setdefault(
        "_real_use_decode_kernel", dsv4_static_compressor.use_decode_kernel
    )
    dsv4_static_compressor.use_decode_kernel = (  # type: ignore[assignment]
        real_use if compressor else (lambda *a: False)
    )
    real_sparse = dsv4_static_decode.__dict__.setdefault(
        "_real_use_sparse_kernels", dsv4_static_decode.use_sparse_kernels
    )
    dsv4_static_decode.use_sparse_kernels = (  # type: ignore[assignment]
        real_sparse if sparse else (lambda *a: False)
    )
    raw = default_model_config(VOCAB, 0, 1)
    runner = "triton" if dev == "cuda" else "torch"
    spec = LayerBuildSpec(dtype=getattr(torch, dtype), device=dev, moe_runner=runner)
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(raw), spec)
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=3 * len(LENGTHS), capacity=512, block_tokens=128)
    size = 1 << max(0, bs - 1).bit_length()
    errs: list[float] = []
    with torch.no_grad(), RouteFollower(deepseek_v4_moe) as routes:
        seqs = [_ids(n + STEPS, 100 * bs + i, dev) for i, n in enumerate(LENGTHS[:bs])]
        static = [model.new_pooled_cache() for _ in range(bs)]
        reference = [model.new_request_cache() for _ in range(bs)]
        for seq, n, a, b in zip(seqs, LENGTHS, static, reference):
            model.prefill(seq[:n], a)
            model.prefill(seq[:n], b)
        for t in range(STEPS):
            ids = torch.stack([seq[n + t] for seq, n in zip(seqs, LENGTHS)])
            if follow:
                routes.record()
            got = model.decode_pooled(ids, static, pad_to=size)
            if follow:
                routes.follow()
            errs.append(mean_rel(got, model.decode(ids, reference)))
    return errs, routes.gaps


def run_matrix(dev: str, dtype: str, bs: int) -> None:
    print(f"batch case, bs {bs}, {dtype}, {dev}: step errors against the reference decode")
    head = f"{'sparse kernels':>14} {'compressor kernel':>17} {'ref follows':>11}"
    print(f"{head} {'median':>8} {'worst':>8} {'>=0.05':>6}  followed flips (router gap)")
    for sparse in (False, True):
        for compressor in (False, True):
            for follow in (False, True):
                errs, gaps = run_batch_case(dev, dtype, bs, sparse, compressor, follow)
                over = sum(e >= 0.05 for e in errs)
                print(
                    f"{sparse!s:>14} {compressor!s:>17} {follow!s:>11} "
                    f"{sorted(errs)[len(errs) // 2]:8.4f} {max(errs):8.4f} {over:6d}  "
                    + (" ".join(f"{g:.1e}" for g in gaps) or "-")
                )
                print("  per step: " + " ".join(f"{e:.3f}" for e in errs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("kernels", "torch"), default="kernels")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--per-layer", action="store_true")
    parser.add_argument("--routing", action="store_true")
    parser.add_argument("--matrix", action="store_true")
    parser.add_argument("--batch", type=int, default=1, help="requests in --matrix (1-6)")
    args = parser.parse_args()
    dev = args.device
    if args.matrix:
        run_matrix(dev, args.dtype, args.batch)
        return
    if dev == "cpu":
        torch.set_num_threads(1)  # tiny tensors; the interpreter is the cost
        _fp32_kernels()
    log: list[tuple[int, float, float]] = []
    routes: list[Route] = []
    if args.routing:
        _record_routing(routes)
    if args.per_layer:
        _compare_layers(log)
    errs, kernel_routes = run_case(dev, args.dtype, args.path == "kernels", log, routes)
    if not args.routing:
        return
    torch_errs, torch_routes = run_case(dev, args.dtype, False, log, routes)
    for t, (a, b) in enumerate(zip(kernel_routes, torch_routes)):
        flips = [(ra, rb) for ra, rb in zip(a, b) if ra[1] != rb[1]]
        if flips:
            ra, rb = flips[0]
            print(
                f"step {t + 3}: {len(flips)} MoE call(s) routed differently (err {errs[t]:.4f} vs "
                f"torch path {torch_errs[t]:.4f}); first: call {ra[0]} {ra[1]} vs {rb[1]}, "
                f"gaps {ra[2]:.2e} / {rb[2]:.2e}"
            )


if __name__ == "__main__":
    main()
