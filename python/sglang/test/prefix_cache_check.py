"""Serving through the prefix cache without the HTTP stack, for the tests and the sweep: a model
runner and the scheduler's policy driven step by step (greedy sampling), with the prefix cache on
or off, over waves of requests (a wave starts when the previous one finished, so a wave's prompts
can extend earlier outputs: multi-turn conversations).

Every request records its greedy tokens, the log-prob of each, the logits of every sampled row,
the prompt tokens it resumed from the cache, and the cache lengths its forwards ended at. The
last lets a cache-off run replay the forwards of a cache-on run (``replay_cuts``): a request's
prefill is cut where its own forwards ended and where the forwards that computed its cached prefix
did. With one request a wave, the same forwards have the same shapes, so that replay must be bit
for bit equal to the cache-on run: what makes the difference to a plain cache-off run (its own
chunking) is then only fp summation order.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.managers.io_struct import FinishReason
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.cpu_model_runner import cpu_model_runner

# A prompt from the records of the waves before (multi-turn), or fixed ids.
PromptFn = Callable[[dict[str, "Record"]], list[int]]


@dataclass
class Record:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    cached_tokens: int = 0
    boundaries: list[int] = field(default_factory=list)  # cache lengths its forwards ended at


@dataclass(frozen=True)
class Turn:
    rid: str
    prompt: PromptFn | Sequence[int]
    max_new: int = 2


@dataclass
class Server:
    runner: ModelRunner
    policy: SchedulePolicy

    @property
    def tree(self) -> RadixCache | None:
        return self.policy.prefix_cache


def tiny_dsv4_checkpoint(path: Path, **overrides: Any) -> str:
    """A tiny DeepSeek V4 (3 layers: ratios 4, 128 and 0, window 16, indexer top-8) with random
    weights, written to ``path``."""
    config = default_model_config(vocab_size=128, bos_token_id=0, eos_token_id=1)
    config.update(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=8,
        sliding_window=16,
        compress_ratios=[4, 128, 0],
        max_position_embeddings=2048,
    )
    config["rope_scaling"] = {**config["rope_scaling"], "original_max_position_embeddings": 512}
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(random_weights(config, seed=7), str(path / "model.safetensors"))
    return str(path)


def make_server(
    model_path: str,
    *,
    radix: bool,
    page_size: int,
    max_total_tokens: int,
    context_length: int = 1024,
    max_running: int = 4,
    chunked_prefill_size: int = 512,
    snapshots: int = 4,
    schedule_policy: str = "fcfs",
    static_decode: bool = False,
) -> Server:
    """A CPU runner on the slot pool, with the prefix cache or without; decode eagerly, or with
    ``static_decode`` through the static decode padded to the graph sizes (and mixed steps split
    into it and an eager forward), as graphs would run it."""
    runner, setup = cpu_model_runner(
        model_path,
        context_length=context_length,
        budget=max_total_tokens,
        max_running_requests=max_running,
        max_total_tokens=max_total_tokens,
        static_without_graphs=static_decode,
        page_size=page_size,
        chunked_prefill_size=chunked_prefill_size,
    )
    assert (runner.static_model is not None) == static_decode, setup.cuda_graph
    tree = None
    if radix:
        runner.enable_prefix_cache(snapshots)
        tree = RadixCache(setup.block_tokens, snapshots)
    policy = SchedulePolicy(
        max_running_requests=setup.max_running_requests,
        max_total_tokens=setup.max_total_tokens or max_total_tokens,
        chunked_prefill_size=chunked_prefill_size,
        block_tokens=setup.block_tokens,
        prefix_cache=tree,
        schedule_policy=schedule_policy,
    )
    return Server(runner, policy)


def run_waves(
    server: Server,
    waves: Sequence[Sequence[Turn]],
    *,
    records: dict[str, Record] | None = None,
    cuts: dict[str, list[int]] | None = None,
) -> dict[str, Record]:
    """Serve the waves in order; ``cuts`` forces prefill chunk ends per request (a replay)."""
    runner, policy = server.runner, server.policy
    records = {} if records is None else records
    for wave in waves:
        reqs = []
        for turn in wave:
            prompt = list(turn.prompt(records) if callable(turn.prompt) else turn.prompt)
            records[turn.rid] = Record(prompt)
            req = Req(turn.rid, prompt, SamplingParams(max_new_tokens=turn.max_new), turn.max_new)
            policy.add(req)
            reqs.append(req)
        while any(r.finish is None for r in reqs):
            _step(server, records, cuts)
        for req in reqs:
            records[req.rid].cached_tokens = req.cached_tokens
    while policy.has_work():  # the last frees (and the blocks they hand to the tree)
        _step(server, records, cuts)
    assert not runner.caches
    return records


def _step(server: Server, records: dict[str, Record], cuts: dict[str, list[int]] | None) -> None:
    runner, policy = server.runner, server.policy
    if cuts is not None:
        for req in policy.waiting:
            req.snapshot_cuts = sorted(c for c in cuts.get(req.rid, []) if c > 0)
    step = policy.next_step()
    logits = runner.execute(step.plan)
    policy.cache_step(step.rows)
    for row in step.rows:
        records[row.req.rid].boundaries.append(row.cache_len)
    if logits is None:
        return
    out = step.plan.output_rows
    for row in step.rows:
        if not row.sample:
            continue
        req = row.req
        lp = torch.log_softmax(logits[out.index(row.last)].float(), dim=-1)
        token = int(lp.argmax())
        req.output_ids.append(token)
        rec = records[req.rid]
        rec.tokens.append(token)
        rec.logprobs.append(float(lp[token]))
        rec.logits.append(logits[out.index(row.last)].clone())
        if len(req.output_ids) >= req.max_new_tokens:
            req.finish = FinishReason("length")
            policy.release(req)


def replay_cuts(records: dict[str, Record], order: Sequence[str]) -> dict[str, list[int]]:
    """Per request (in serving ``order``), the chunk ends a cache-off run must use to do the
    same forwards as the cache-on run: its own forwards' ends and, below its cached prefix, those
    of the earliest request whose forwards ended there on the same tokens (who saved the
    snapshot), recursively."""
    history: dict[str, list[int]] = {}
    for i, rid in enumerate(order):
        rec = records[rid]
        own = [b for b in rec.boundaries if b > rec.cached_tokens]
        inherited: list[int] = []
        c = rec.cached_tokens
        if c:
            seq = rec.prompt
            for prev in order[:i]:
                full = records[prev].prompt + records[prev].tokens
                if c in history[prev] and full[:c] == seq[:c]:
                    inherited = [b for b in history[prev] if b <= c]
                    break
            else:
                raise AssertionError(f"{rid}: no earlier request ended a forward at {c}")
        history[rid] = sorted(set(inherited + own))
    return history


# --- scenarios ------------------------------------------------------------------------------------


def random_ids(n: int, vocab: int, generator: torch.Generator, low: int = 2) -> list[int]:
    return torch.randint(low, vocab, (n,), generator=generator).tolist()


def shared_prefix_waves(
    base: list[int], shared: Sequence[int], vocab: int, seed: int, max_new: int = 2
) -> list[list[Turn]]:
    """``base`` alone, then one request a wave sharing ``s`` of its tokens for each ``s`` (then
    random tokens to the same length): every divergence point of the sweep."""
    g = torch.Generator().manual_seed(seed)
    waves = [[Turn("base", base, max_new)]]
    for s in shared:
        waves.append([Turn(f"s{s}", base[:s] + random_ids(len(base) - s, vocab, g), max_new)])
    return waves


def conversation_waves(
    first: list[int], turns: int, message: int, max_new: int, vocab: int, seed: int, name: str = "t"
) -> list[list[Turn]]:
    """A chat: turn ``k`` sends the whole conversation so far (every prompt and output) plus a
    new message of ``message`` tokens."""
    g = torch.Generator().manual_seed(seed)
    messages = [random_ids(message, vocab, g) for _ in range(turns)]

    def turn(k: int) -> PromptFn:
        def prompt(records: dict[str, Record]) -> list[int]:
            if k == 0:
                return first
            prev = records[f"{name}{k - 1}"]
            return prev.prompt + prev.tokens + messages[k]

        return prompt

    return [[Turn(f"{name}{k}", turn(k), max_new)] for k in range(turns)]


def fixed_prompts(waves: Sequence[Sequence[Turn]], records: dict[str, Record]) -> list[list[Turn]]:
    """The same waves with the prompts a run built, fixed (for another run to replay)."""
    return [[Turn(t.rid, records[t.rid].prompt, t.max_new) for t in w] for w in waves]


def worst_difference(got: dict[str, Record], want: dict[str, Record]) -> tuple[float, float]:
    """Greedy tokens must be equal; the largest |difference| of the sampled tokens' log-probs
    and of the sampled rows' logits (relative to the largest |logit|)."""
    lp, logits = 0.0, 0.0
    for rid, w in want.items():
        g = got[rid]
        assert g.prompt == w.prompt, rid
        assert g.tokens == w.tokens, (rid, g.tokens, w.tokens)
        lp = max(lp, *(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)))
        for a, b in zip(g.logits, w.logits):
            logits = max(logits, float((a - b).abs().max() / b.abs().max()))
    return lp, logits


def check_cache_on_vs_off(
    got: dict[str, Record], want: dict[str, Record], tol: float
) -> dict[str, int]:
    """A cache-on run's records ``got`` against a cache-off run's ``want`` of the same prompts:
    the same greedy tokens, log-probs and logits within ``tol`` (:func:`worst_difference`).
    -> the prompt tokens each request resumed from the cache (printed with the errors)."""
    lp, logits = worst_difference(got, want)
    cached = {rid: r.cached_tokens for rid, r in got.items()}
    print(f"cache on vs off: max |d logprob| {lp:.2e}, logits rel {logits:.2e}; cached {cached}")
    assert lp < tol and logits < tol
    return cached


def run_conversation_and_branches(
    server: Server,
    waves: Sequence[Sequence[Turn]],
    left: list[int],
    right: list[int],
    page: int,
) -> tuple[dict[str, Record], list[list[Turn]]]:
    """Run the conversation ``waves`` (``conversation_waves``, turns ``t0``..), then two
    continuations of the whole conversation at once from its cached prefix (``left`` and
    ``right`` appended to the last turn's prompt and output, 4 tokens each). Checks that each
    turn resumes at the last ``page`` edge of the previous prompt + output (a decode snapshot)
    and that both branches hit the whole stem's last edge. -> (records, the branch wave)."""
    got = run_waves(server, waves)
    last = got[waves[-1][0].rid]
    stem = last.prompt + last.tokens
    branches = [[Turn("left", stem + left, 4), Turn("right", stem + right, 4)]]
    got = run_waves(server, branches, records=got)
    cached = {rid: r.cached_tokens for rid, r in got.items()}
    print(f"conversation cached tokens {cached}")
    rids = [w[0].rid for w in waves]
    for prev_rid, rid in itertools.pairwise(rids):
        prev = got[prev_rid]
        assert cached[rid] == (len(prev.prompt) + len(prev.tokens) - 1) // page * page > 0
    assert cached["left"] == cached["right"] == (len(stem) - 1) // page * page
    return got, branches


def check_against_cache_off(
    cache_off: Callable[[], Server],
    waves: Sequence[Sequence[Turn]],
    branches: Sequence[Sequence[Turn]],
    got: dict[str, Record],
    tol: float,
) -> None:
    """A cache-on run's records ``got`` of ``waves`` then ``branches`` against fresh cache-off
    servers (``cache_off()``): the same greedy tokens, log-probs and logits within ``tol`` on the
    same prompts, and bit for bit equal logits where the cache-off run replays the cache-on
    run's forwards (``replay_cuts``; the conversation, one request a step)."""
    fixed = fixed_prompts(waves, got) + fixed_prompts(branches, got)
    check_cache_on_vs_off(got, run_waves(cache_off(), fixed), tol)
    order = [t.rid for w in waves for t in w]
    replay = run_waves(cache_off(), fixed_prompts(waves, got), cuts=replay_cuts(got, order))
    for rid in order:
        assert all(torch.equal(a, b) for a, b in zip(got[rid].logits, replay[rid].logits)), rid
