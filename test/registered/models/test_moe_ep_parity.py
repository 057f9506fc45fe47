"""Expert parallelism (``--moe-a2a-backend ep``, CPU ranks over gloo, rows moved by all-to-all)
gives TP=1's greedy tokens on both models' tiny configs, fp32 with the torch runner: a batched
prefill of prompts of mixed lengths (one of a single token), then batched greedy decode steps.

- TP=2 + EP=2: whole experts a rank;
- TP=4 + EP=2: half the experts a rank, each expert's intermediate dim sliced over the two ranks
  that hold it (their partial sums reduced over that pair).

Each rank holds and loads only its experts, and only its slice of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A as DSV4_CONFIG
from sglang.test.dsv4_tiny import reference_model, write_release
from sglang.test.kimi_k3_tiny import CONFIG_A as KIMI_CONFIG
from sglang.test.kimi_k3_tiny import config as kimi_config
from sglang.test.kimi_k3_tiny import make_model
from sglang.test.moe_placement import expert_placement, moe_held
from sglang.test.multiprocess import run_distributed
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=70)

# TP=4 splits attention four ways: the tiny configs with four heads (and output groups).
DSV4_TP4 = dict(DSV4_CONFIG, o_groups=4)
KIMI_TP4 = dict(
    KIMI_CONFIG,
    num_attention_heads=4,
    num_key_value_heads=4,
    linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], num_heads=4),
)
CONFIGS = {2: (DSV4_CONFIG, KIMI_CONFIG), 4: (DSV4_TP4, KIMI_TP4)}

LENGTHS = (9, 1, 17, 4)
STEPS = 4


def _prompts(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


@torch.no_grad()
def _greedy(model: Any, prompts: list[torch.Tensor]) -> list[list[int]]:
    """Every prompt prefilled in one forward, then ``STEPS`` batched greedy decode steps."""
    caches = [model.new_request_cache() for _ in prompts]
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(p.shape[0]) for p in prompts])
    logits = model(ids, pos, model.batch_type([p.shape[0] for p in prompts], caches))
    last = torch.cumsum(torch.tensor(LENGTHS), 0) - 1
    nxt = logits[last].argmax(-1)
    out = [[int(t)] for t in nxt]
    for _ in range(STEPS - 1):
        nxt = model.decode(nxt, caches).argmax(-1)
        for row, t in zip(out, nxt.tolist(), strict=True):
            row.append(int(t))
    return out


def _spec(rank: int, world: int, a2a: str, ep_size: int | None) -> LayerBuildSpec:
    return LayerBuildSpec(
        dtype=torch.float32,
        tp_rank=rank,
        tp_size=world,
        moe_runner="torch",
        a2a_backend=a2a,
        moe_ep_size=ep_size,
    )


def _load_dsv4(path: str, rank: int, world: int, a2a: str, ep_size: int | None = None) -> Any:
    from sglang.srt.models.loading import load_model

    return load_model(path, _spec(rank, world, a2a, ep_size), LoadOptions(progress=False))


def _load_kimi(
    cfg: dict[str, Any],
    ckpt: dict[str, torch.Tensor],
    rank: int,
    world: int,
    a2a: str,
    ep_size: int | None = None,
) -> Any:
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
    from sglang.srt.models.loading import load_weights

    model = KimiK3ForCausalLM(kimi_config(cfg), _spec(rank, world, a2a, ep_size))
    load_weights(model, ckpt, LoadOptions(progress=False))
    return model


def _rank(
    rank: int, world: int, ep_size: int, dsv4_path: str, kimi_ckpt: dict[str, torch.Tensor]
) -> dict[str, Any]:
    from sglang.srt.distributed import parallel_state as ps

    # One thread a rank: more ranks than cores, and every collective waits for the slowest.
    torch.set_num_threads(1)
    ps.initialize_model_parallel(world)
    dsv4 = _load_dsv4(dsv4_path, rank, world, "ep", ep_size)
    kimi = _load_kimi(CONFIGS[world][1], kimi_ckpt, rank, world, "ep", ep_size)
    return {
        "dsv4": _greedy(dsv4, _prompts(DSV4_CONFIG["vocab_size"])),
        "kimi": _greedy(kimi, _prompts(KIMI_CONFIG["vocab_size"])),
        "held": (moe_held(dsv4), moe_held(kimi)),
    }


@pytest.mark.parametrize(("world", "ep_size"), [(2, 2), (4, 2)])
def test_ep_greedy_tokens_equal_tp1(tmp_path: Path, world: int, ep_size: int) -> None:
    dsv4_cfg, kimi_cfg = CONFIGS[world]
    write_release(tmp_path, dsv4_cfg, reference_model(dsv4_cfg, seed=21))
    kimi_ckpt = dict(
        k3_release.model_release_tensors(make_model(kimi_cfg, seed=22), experts="bf16").tensors
    )
    want = {
        "dsv4": _greedy(
            _load_dsv4(str(tmp_path), 0, 1, "none"), _prompts(DSV4_CONFIG["vocab_size"])
        ),
        "kimi": _greedy(
            _load_kimi(kimi_cfg, kimi_ckpt, 0, 1, "none"), _prompts(KIMI_CONFIG["vocab_size"])
        ),
    }
    results = run_distributed(_rank, world, ep_size, str(tmp_path), kimi_ckpt, timeout_s=300)
    for rank, got in enumerate(results):
        assert got["dsv4"] == want["dsv4"], (rank, got["dsv4"], want["dsv4"])
        assert got["kimi"] == want["kimi"], (rank, got["kimi"], want["kimi"])
        dsv4 = (DSV4_CONFIG["n_routed_experts"], DSV4_CONFIG["moe_intermediate_size"])
        kimi = (KIMI_CONFIG["num_experts"], KIMI_CONFIG["moe_intermediate_size"])
        assert got["held"] == (
            expert_placement(rank, world, ep_size, *dsv4),
            expert_placement(rank, world, ep_size, *kimi),
        ), rank
    # the tokens are not trivially constant
    assert len({t for row in want["dsv4"] for t in row}) > 2


if __name__ == "__main__":
    run_this_file(__file__)
