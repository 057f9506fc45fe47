"""Random inputs for DeepSeek V4's sparse prefill attention and the two ways to compute it: the
torch path (``dsv4_attention``, a dense visibility mask) and the Triton kernel (the indexer's picks
as ids), per call and inside the model. Shared by the CPU (interpreter) and GPU kernel tests and
the kernel benchmark."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.kernels.ops.attention.sparse_prefill_attention import sparse_prefill_attention
from sglang.srt.layers.attention.dsv4_core import dsv4_attention
from sglang.srt.layers.attention.dsv4_indexer import LightningIndexer
from sglang.srt.layers.build_spec import LayerBuildSpec


def scoring_indexer(
    heads: int, dim: int, ratio: int, topk: int, dtype: torch.dtype, device: str
) -> LightningIndexer:
    """An indexer for its scoring and top-k only (``pick`` / ``select`` on given queries, weights
    and keys): its projections are tiny, they are never run."""
    return LightningIndexer(
        LayerBuildSpec(dtype=dtype, device=device),
        hidden_size=16,
        q_lora_rank=8,
        n_heads=heads,
        head_dim=dim,
        ratio=ratio,
        topk=topk,
        rms_eps=1e-6,
    )


@dataclass(frozen=True)
class PrefillCase:
    n: int  # new queries
    heads: int
    dim: int
    window: int
    ratio: int  # 0: window only
    q_first: int  # position of the first new query (> 0: a later prefill chunk)
    topk: int = 0  # > 0: indexed (ratio-4 style picks), else every complete block is visible
    fp32_q: bool = False  # an fp32 query (split into three bf16 parts by the kernel)
    extra_rows: int = 0  # window rows older than any query needs (the kernel must skip them)


@dataclass(frozen=True)
class PrefillInputs:
    case: PrefillCase
    q: torch.Tensor
    pos: torch.Tensor
    win_kv: torch.Tensor
    win_first: int
    entries: torch.Tensor | None
    mask: torch.Tensor | None  # the torch path's [n, N] visibility
    picks: torch.Tensor | None  # the kernel's [n, k] ids (indexed layers)
    sink: torch.Tensor

    @property
    def scale(self) -> float:
        return self.case.dim**-0.5


def make_inputs(case: PrefillCase, device: str, gen: torch.Generator) -> PrefillInputs:
    """Random bf16 keys and (bf16 or fp32) queries; the picks as the indexer makes them (random
    scores, invisible entries at ``-inf``, a stable descending sort, ``k = min(topk, N)``)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    c = case
    ring = min(c.q_first, c.window - 1 + c.extra_rows)
    win_first = c.q_first - ring
    win_kv = randn(ring + c.n, c.dim).to(torch.bfloat16)
    q = randn(c.n, c.heads, c.dim) * 2.0
    q = q if c.fp32_q else q.to(torch.bfloat16)
    sink = randn(c.heads)
    pos = torch.arange(c.q_first, c.q_first + c.n, device=device)
    entries = mask = picks = None
    if c.ratio:
        total = (c.q_first + c.n) // c.ratio
        entries = randn(total, c.dim).to(torch.bfloat16)
        ids = torch.arange(total, device=device)
        ok = ids[None, :] < ((pos + 1) // c.ratio)[:, None]
        mask = ok
        if c.topk:
            scores = randn(c.n, total).masked_fill(~ok, float("-inf"))
            k = min(c.topk, total)
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            picked = torch.zeros_like(ok)
            picked.scatter_(1, picks, True)
            mask = picked & ok
    return PrefillInputs(c, q, pos, win_kv, win_first, entries, mask, picks, sink)


def torch_path(x: PrefillInputs) -> torch.Tensor:
    c = x.case
    return dsv4_attention(
        x.q,
        x.pos,
        c.q_first,
        x.win_kv,
        x.win_first,
        x.entries,
        x.mask,
        x.sink,
        scale=x.scale,
        window=c.window,
    )


def kernel_path(x: PrefillInputs, **tuning: int) -> torch.Tensor:
    c = x.case
    return sparse_prefill_attention(
        x.q,
        c.q_first,
        x.win_kv,
        x.win_first,
        x.sink,
        scale=x.scale,
        window=c.window,
        entries=x.entries,
        ratio=c.ratio,
        picks=x.picks,
        **tuning,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def max_row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst query's relative error (every head of it)."""
    return float(((out - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max())


def model_layer_errors(device: str, *, first: int, second: int, fresh: int) -> list[float]:
    """The default model (bf16, random weights) prefills a request in two chunks (``first`` tokens,
    then ``second`` more in one batch with a fresh request of ``fresh`` tokens), once on the torch
    core and once on the kernel; the kernel run's attention layers get the inputs the torch run's
    saw. -> each layer call's worst row error of the attention output (before inverse RoPE)."""
    from sglang.srt.default_model.config import default_model_config
    from sglang.srt.default_model.generate import random_weights
    from sglang.srt.layers.attention import dsv4_attention as attn_mod
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.model_loader.load_options import LoadOptions
    from sglang.srt.models.deepseek_v4 import DeepseekV4Batch, DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
    from sglang.srt.models.loading import load_weights

    vocab = 64
    raw = default_model_config(vocab, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw), LayerBuildSpec(dtype=torch.bfloat16, device=device)
    )
    load_weights(model, random_weights(raw, seed=4), LoadOptions(progress=False))
    model.eval()
    layers = [m for m in model.modules() if isinstance(m, attn_mod.DeepseekV4Attention)]
    kernel_reason = attn_mod.prefill_kernel_reason
    if kernel_reason(torch.empty(1, 1, 64, device=device), torch.bfloat16) is not None:
        raise RuntimeError("the prefill kernel does not run here (CUDA or TRITON_INTERPRET=1)")
    state = {"kernel": False, "call": 0}
    inputs: list[torch.Tensor] = []  # each layer call's input, in call order (torch run)
    outputs: dict[bool, list[torch.Tensor]] = {False: [], True: []}

    def reason(q: torch.Tensor, key_dtype: torch.dtype) -> str | None:
        return kernel_reason(q, key_dtype) if state["kernel"] else "the torch core, for the test"

    def pre(_m: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not state["kernel"]:
            inputs.append(args[0].clone())
            return args
        x = inputs[state["call"]]
        state["call"] += 1
        return (x, *args[1:])

    def recording(attn: attn_mod.DeepseekV4Attention) -> Callable[..., torch.Tensor]:
        plain = attn.output

        def output(o: torch.Tensor, p: attn_mod.Projected, dtype: torch.dtype) -> torch.Tensor:
            outputs[bool(state["kernel"])].append(o.clone())
            return plain(o, p, dtype)

        return output

    hooks = [attn.register_forward_pre_hook(pre) for attn in layers]
    for attn in layers:
        attn.output = recording(attn)  # type: ignore[method-assign]
    attn_mod.prefill_kernel_reason = reason
    try:
        g = torch.Generator().manual_seed(1)
        seq_a = torch.randint(0, vocab, (first + second,), generator=g).to(device)
        seq_b = torch.randint(0, vocab, (fresh,), generator=g).to(device)
        for kernel in (False, True):
            state["kernel"] = kernel
            a, b = model.new_request_cache(), model.new_request_cache()
            model.prefill(seq_a[:first], a)
            # a continues at position `first` (chunked prefill) in one batch with a fresh b
            ids = torch.cat([seq_a[first:], seq_b])
            pos = torch.cat([torch.arange(first, first + second), torch.arange(fresh)])
            model.forward(ids, pos.to(device), DeepseekV4Batch([second, fresh], [a, b]))
    finally:
        attn_mod.prefill_kernel_reason = kernel_reason
        for h in hooks:
            h.remove()
    assert state["call"] == len(inputs) == 2 * len(layers)
    return [max_row_err(got, want) for got, want in zip(outputs[True], outputs[False], strict=True)]
