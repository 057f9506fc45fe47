"""DeepSeek V4 greedy parity against transformers' ``DeepseekV4ForCausalLM``: random tiny configs,
every parameter random, prompts at the block / window / top-k boundaries, greedy decoding through
the engine's paths (chunked prefill of several requests per forward, then batched decode: the
per-request caches, the slot pool's static decode, or its CUDA-graph replay).

The reference is transformers (pure torch, fp32) with the two rules where DeepSeek's own inference
code (``inference/model.py`` of the V4 release) decides (docs/parity.md):
- ``swiglu_limit <= 0`` means no clamp (DeepSeek's ``Expert``); transformers would clamp at 0;
- exact ties in the indexer's top-k (an entry whose every head's ReLU clips scores exactly 0) go to
  the earlier entry. DeepSeek's code and transformers both call ``torch.topk``, whose tie order is
  unspecified (on CPU it depends on the row length and k), so no tie rule is "the model's"; ours is
  the one a chunked prefill can keep, and the reference is given the same rule.

Greedy parity is checked teacher-forced: after our engine generated ``new_tokens`` per prompt, one
reference forward over ``prompt + generated`` gives the reference logits for every step along the
same prefix, so a step "diverges" when our token is not the reference argmax by more than
``margin_tol`` (a smaller margin is a near-tie that fp32 rounding may flip: counted, not failed).
Prefill rows of every prompt position are compared too, so a prompt of length n also checks the
first token of every shorter prompt.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DeepseekV4Config
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.chunked_prefill import chunked_prefill
from sglang.test.release_checkpoint.deepseek_v4 import TINY_BASE

# transformers warns that tiny YaRN factors disagree with max_position_embeddings; irrelevant.
logging.getLogger("transformers").setLevel(logging.ERROR)

DecodePath = Literal["eager", "pooled", "graph"]
# A tie rule's offsets must stay below the rounding of any non-zero score (|score| >> 1e-26).
_TIE_STEP = 1e-30
# Largest context the sweep's configs cover (positions of YaRN and the slot pool).
MAX_POSITIONS = 512

# The tie case of docs/parity.md (finding 1), run by the sweep test and served by the engine test:
# window 16, indexer top-k 5 of two heads (exact index-score ties are common), mixed layer types,
# hash-routed first layers; prompts at 30..47 and around the ratio-128 block; model seed 14.
TIE_CASE_CONFIG: dict[str, Any] = dict(
    TINY_BASE,
    num_hidden_layers=4,
    compress_ratios=[128, 4, 0, 4],
    num_hash_layers=2,
    sliding_window=16,
    index_topk=5,
    index_n_heads=2,
)
TIE_CASE_LENGTHS: tuple[int, ...] = (*range(30, 48), 128, 129, 140, 150)
TIE_CASE_SEED = 14


@dataclass(frozen=True)
class SweepCase:
    """One randomised model and the prompts decoded through it."""

    seed: int
    config: dict[str, Any] = field(hash=False)  # DeepseekV4Config keyword arguments
    prompt_lens: tuple[int, ...]
    new_tokens: int
    chunk: int | None  # prefill chunk size (None: each prompt in one forward)
    path: DecodePath

    @property
    def label(self) -> str:
        c = self.config
        kinds = "".join({0: "S", 4: "C", 128: "H"}[r] for r in c["compress_ratios"])
        return (
            f"s{self.seed} {kinds} hash{c.get('num_hash_layers', 3)} w{c['sliding_window']} "
            f"k{c['index_topk']} ih{c['index_n_heads']} hc{c.get('hc_mult', 4)} "
            f"chunk{self.chunk or '-'} {self.path}"
        )


@dataclass(frozen=True)
class CaseResult:
    case: SweepCase
    max_err: float  # max |ours - reference| over every compared logit
    max_ref: float  # max |reference logit|
    steps: int  # greedy steps compared
    positions: int  # prefill rows compared
    near_ties: int  # our token != reference argmax, but by less than the margin tolerance
    tie_breaks: int  # reference indexer rows whose top-k boundary fell inside an exact tie
    first_divergence: tuple[int, int] | None  # (prompt length, absolute position)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None


# --- random cases --------------------------------------------------------------------------------


def random_config(rng: random.Random, ratios: Sequence[int] | None = None) -> dict[str, Any]:
    """A tiny DeepSeek V4 config with every structural choice random."""
    n_layers = len(ratios) if ratios is not None else rng.randint(2, 4)
    if ratios is None:
        ratios = [rng.choice((0, 4, 128)) for _ in range(n_layers)]
    heads = rng.choice((2, 4))
    o_groups = rng.choice([g for g in (1, 2) if heads % g == 0])
    experts = rng.choice((3, 4, 6))
    yarn = rng.random() < 0.5
    cfg: dict[str, Any] = {
        "vocab_size": rng.choice((64, 96)),
        # multiples of 64 / powers of two: the CUDA kernels' tiles (the GPU sweep runs these too)
        "hidden_size": rng.choice((64, 128)),
        "moe_intermediate_size": rng.choice((16, 32)),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "head_dim": rng.choice((16, 24)),
        "qk_rope_head_dim": rng.choice((4, 8)),
        "q_lora_rank": rng.choice((8, 16)),
        "o_groups": o_groups,
        "o_lora_rank": rng.choice((4, 8)),
        "n_routed_experts": experts,
        "num_experts_per_tok": rng.randint(1, min(3, experts)),
        "index_n_heads": rng.choice((1, 2, 4, 8)),
        "index_head_dim": rng.choice((8, 16)),
        # below, around and above the number of ratio-4 entries of the prompts (<= 75)
        "index_topk": rng.choice((1, 2, 3, 5, 8, 16, 40, 80)),
        # below the ratio-4 block, between the blocks, around and above the ratio-128 block
        "sliding_window": rng.choice((1, 2, 3, 5, 8, 16, 33, 127, 129)),
        "compress_ratios": list(ratios),
        "num_hash_layers": rng.randint(0, n_layers),
        "hc_mult": rng.choice((1, 2, 4)),
        "hc_sinkhorn_iters": rng.choice((1, 3, 20)),
        "hc_eps": rng.choice((1e-6, 1e-3)),
        "rms_norm_eps": rng.choice((1e-6, 1e-5)),
        "swiglu_limit": rng.choice((0.0, 0.5, 2.0, 10.0)),
        "routed_scaling_factor": rng.choice((1.0, 1.5, 2.5)),
        "rope_theta": rng.choice((1000.0, 10000.0)),
        "compress_rope_theta": rng.choice((40000.0, 160000.0)),
        "max_position_embeddings": MAX_POSITIONS,
    }
    if yarn:
        cfg["rope_scaling"] = {
            "type": "yarn",
            "factor": rng.choice((2.0, 4.0, 16.0)),
            "original_max_position_embeddings": rng.choice((32, 64, 128)),
            "beta_fast": 32,
            "beta_slow": 1,
        }
    return cfg


def boundary_lengths(
    cfg: dict[str, Any], rng: random.Random, count: int, max_len: int
) -> list[int]:
    """``count`` prompt lengths in ``1..max_len``, most next to a boundary of this config: the
    ratio-4 and ratio-128 blocks, the window, and where the visible ratio-4 entries pass top-k."""
    w, k = cfg["sliding_window"], cfg["index_topk"]
    marks = {1, 2, 3, 4, 5, w, 4 * k, 128, 256}
    marks |= {4 * rng.randint(1, max_len // 4) for _ in range(3)}
    near = sorted({m + d for m in marks for d in (-1, 0, 1) if 1 <= m + d <= max_len})
    picked = rng.sample(near, min(count, len(near)))
    while len(picked) < count:
        picked.append(rng.randint(1, max_len))
    return sorted(picked)


# Every attention-layer mix of one to three layers (sliding / CSA ratio 4 / HCA ratio 128).
ALL_MIXES: tuple[tuple[int, ...], ...] = tuple(
    m for n in (1, 2, 3) for m in itertools.product((0, 4, 128), repeat=n)
)


def mix_for(seed: int) -> tuple[int, ...] | None:
    """Seeds walk through :data:`ALL_MIXES` (then one random mix) so a run of ``len + 1``
    consecutive seeds covers every mix."""
    i = seed % (len(ALL_MIXES) + 1)
    return ALL_MIXES[i] if i < len(ALL_MIXES) else None


def random_case(
    seed: int,
    *,
    max_len: int = 300,
    num_prompts: int = 3,
    new_tokens: int = 6,
    path: DecodePath = "eager",
    ratios: Sequence[int] | None = None,
) -> SweepCase:
    rng = random.Random(seed)
    cfg = random_config(rng, ratios if ratios is not None else mix_for(seed))
    lens = boundary_lengths(cfg, rng, num_prompts, max_len)
    # One-token chunks only for short prompts: each chunk is one forward of every prompt.
    chunk = rng.choice((None, 1, 3, 16, 64) if max(lens) <= 64 else (None, 7, 16, 64))
    return SweepCase(seed, cfg, tuple(lens), new_tokens, chunk, path)


# --- models --------------------------------------------------------------------------------------


@torch.no_grad()
def randomize_(model: HFDeepseekV4, seed: int) -> HFDeepseekV4:
    """Fill *every* state-dict entry, including those transformers initialises to 0 or 1 (sinks,
    mHC base/scale, ape, router bias, norms), with random values of a sensible scale: weights
    ~ N(0, 1/fan_in), norm weights U(0.5, 1.5), mHC scales around 1, other vectors N(0, 0.5^2);
    ``tid2eid`` gets distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    num_experts = model.config.n_routed_experts
    for name, t in model.state_dict().items():
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(num_experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])
            ]
            t.copy_(torch.stack(rows))
        elif not t.dtype.is_floating_point:
            continue
        elif name.endswith("norm.weight") or "layernorm" in name:
            t.copy_(torch.rand(t.shape, generator=g) + 0.5)
        elif t.dim() >= 2:
            t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
        else:
            offset = 1.0 if name.endswith("scale") else 0.0
            t.copy_(torch.randn(t.shape, generator=g) * 0.5 + offset)
    return model


class _TieCounter:
    """Forward hook on transformers' indexer scorer: exact-zero scores get a tiny descending offset
    by entry index (the earlier entry wins a tie, as in our indexer) and rows whose top-k boundary
    fell inside such a tie are counted. Non-zero scores are untouched."""

    def __init__(self, topk: int, ratio: int, *, apply: bool = True) -> None:
        self.topk, self.ratio, self.apply, self.count = topk, ratio, apply, 0

    def __call__(self, module: Any, args: Any, scores: torch.Tensor) -> torch.Tensor:
        s, n = scores.shape[-2], scores.shape[-1]
        entry = torch.arange(n, device=scores.device)
        # The full-sequence reference runs from position 0: row s sees (s + 1) // ratio entries.
        rows = torch.arange(s, device=scores.device)[:, None]
        visible = entry[None, :] < (rows + 1) // self.ratio
        k = min(self.topk, n)
        masked = scores.masked_fill(~visible, float("-inf"))
        above = (masked > 0).sum(-1)
        zeros = ((masked == 0) & visible).sum(-1)
        self.count += int(((above < k) & (above + zeros > k)).sum())
        if not self.apply:
            return scores
        ramp = -_TIE_STEP * (entry + 1).to(scores.dtype)
        return torch.where(scores == 0, ramp, scores)


def reference_config(cfg: dict[str, Any]) -> DeepseekV4Config:
    """transformers' config for ``cfg`` under DeepSeek's rules (no clamp for a limit <= 0)."""
    ref = dict(cfg)
    if ref.get("swiglu_limit") is not None and ref["swiglu_limit"] <= 0:
        ref["swiglu_limit"] = float("inf")
    return DeepseekV4Config(**ref)


def reference_model(
    cfg: dict[str, Any], seed: int, *, tie_rule: bool = True
) -> tuple[HFDeepseekV4, _TieCounter]:
    """transformers' model for ``cfg`` with random weights; its indexer's exact ties are counted
    and (``tie_rule``) broken toward the earlier entry, else left to ``torch.topk``."""
    torch.manual_seed(seed)
    hf = randomize_(HFDeepseekV4(reference_config(cfg)).eval(), seed)
    ties = _TieCounter(cfg["index_topk"], 4, apply=tie_rule)
    for module in hf.modules():
        if type(module).__name__ == "DeepseekV4IndexerScorer":
            module.register_forward_hook(ties)
    return hf, ties


def our_model(
    hf: HFDeepseekV4,
    cfg: dict[str, Any],
    *,
    device: torch.device | str = "cpu",
    moe_runner: str = "torch",
) -> DeepseekV4ForCausalLM:
    """Ours from ``cfg`` itself (not from the reference's adjusted config) with its weights."""
    config = DeepseekV4ModelConfig.from_hf_config(DeepseekV4Config(**cfg))
    model = DeepseekV4ForCausalLM(
        config, LayerBuildSpec(dtype=torch.float32, device=device, moe_runner=moe_runner)
    )
    load_weights(
        model, {k: v.to(device) for k, v in hf.state_dict().items()}, LoadOptions(progress=False)
    )
    return model.eval()


# --- running a case ------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[torch.Tensor],
    new_tokens: int,
    *,
    chunk: int | None,
    path: DecodePath,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ``new_tokens`` per prompt: chunked prefill of all prompts (each forward takes the
    next chunk of every unfinished prompt), then batched decode. -> (tokens per prompt, logits per
    prompt ``[len + new_tokens - 1, V]``: every prefill row, then each decode step's)."""
    dev = model.device
    graphs = None
    if path == "eager":
        caches = [model.new_request_cache() for _ in prompts]
    else:
        capacity = max(len(p) for p in prompts) + new_tokens + 1
        model.enable_slot_pool(max_slots=len(prompts), capacity=capacity)
        caches = [model.new_pooled_cache() for _ in prompts]
        if path == "graph":
            # Sizes up to the next power of two: a batch of 3 replays the 4-row graph.
            pad = 1 << (len(prompts) - 1).bit_length()
            graphs = CudaGraphRunner(model, capture_batch_sizes(pad), dev)
            graphs.capture()
    rows = chunked_prefill(model, prompts, caches, chunk, dev)
    tokens = [[int(torch.cat(r)[-1].argmax())] for r in rows]
    for _ in range(new_tokens - 1):
        ids = torch.tensor([t[-1] for t in tokens], device=dev)
        if path == "eager":
            logits = model.decode(ids, caches)
        elif graphs is not None:
            logits = model.decode_pooled(ids, caches, step=graphs.replay)
        else:
            # Padded like a graph batch: padding rows must not disturb the real ones.
            pad = 1 << (len(prompts) - 1).bit_length()
            logits = model.decode_pooled(ids, caches, pad_to=pad)
        for i, t in enumerate(tokens):
            rows[i].append(logits[i : i + 1].clone())
            t.append(int(logits[i].argmax()))
    if path != "eager":
        for cache in caches:
            model.free_pooled_cache(cache)
    return tokens, [torch.cat(r).float().cpu() for r in rows]


@torch.no_grad()
def run_case(
    case: SweepCase,
    *,
    device: torch.device | str = "cpu",
    margin_tol: float | None = 1e-4,
    tie_rule: bool = True,
) -> CaseResult:
    """Run ``case`` through our engine and check it against the reference (module docstring).
    ``margin_tol=None``: a row may flip only where the reference margin is below twice our error
    on that row (what rounding of that size can do; for GPU kernels whose rounding is larger)."""
    hf, ties = reference_model(case.config, case.seed, tie_rule=tie_rule)
    runner = "triton" if case.path == "graph" else "torch"
    ours = our_model(hf, case.config, device=device, moe_runner=runner)
    # The fp32 triton MoE kernel fits shared memory only in its smallest (decode-sized) tiles.
    chunk = min(case.chunk or 4, 4) if runner == "triton" else case.chunk
    vocab = case.config["vocab_size"]
    g = torch.Generator().manual_seed(case.seed + 7919)
    seq = torch.randint(0, vocab, (max(case.prompt_lens),), generator=g)
    prompts = [seq[:n] for n in case.prompt_lens]  # cut from one sequence, as users do
    tokens, logits = generate(ours, prompts, case.new_tokens, chunk=chunk, path=case.path)
    max_err = max_ref = 0.0
    near = steps = positions = 0
    first: tuple[int, int] | None = None
    for prompt, out, got in zip(prompts, tokens, logits):
        n = prompt.shape[0]
        full = torch.cat([prompt, torch.tensor(out[:-1], dtype=torch.long)])
        ref = hf(full[None]).logits[0].float()
        max_err = max(max_err, float((got - ref).abs().max()))
        max_ref = max(max_ref, float(ref.abs().max()))
        # Our choice at each row: the prompt's next token for prefill rows, our token after.
        chosen = got.argmax(-1)
        for row in range(ref.shape[0]):
            positions += row < n - 1
            steps += row >= n - 1
            pick = int(chosen[row])
            best = int(ref[row].argmax())
            if pick == best:
                continue
            row_tol = (
                2 * float((got[row] - ref[row]).abs().max()) if margin_tol is None else (margin_tol)
            )
            if float(ref[row, best] - ref[row, pick]) <= row_tol:
                near += 1
            elif first is None or row < first[1]:
                first = (n, row)
    return CaseResult(case, max_err, max_ref, steps, positions, near, ties.count, first)


def format_table(results: Sequence[CaseResult]) -> str:
    head = f"{'case':<58} {'lengths':<18} {'max err':>8} {'near':>4} {'ties':>5}  first divergence"
    lines = [head, "-" * len(head)]
    for r in results:
        lens = ",".join(map(str, r.case.prompt_lens))
        div = (
            "-"
            if r.first_divergence is None
            else (f"len {r.first_divergence[0]} pos {r.first_divergence[1]}")
        )
        lines.append(
            f"{r.case.label:<58} {lens:<18} {r.max_err:8.1e} {r.near_ties:4d} "
            f"{r.tie_breaks:5d}  {div}"
        )
    return "\n".join(lines)
