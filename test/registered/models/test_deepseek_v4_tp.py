"""DeepSeek V4 at tensor parallel 2 (two CPU ranks over gloo) gives the TP=1 logits, both loaded
from a release-format checkpoint with FP8 128x128 dense weights (written by the test kit): attention
heads / output groups / sinks split by rank with the wo_b all-reduce, experts and shared expert
split over the intermediate dim with one MoE all-reduce; and, with ``moe_a2a_backend=megamoe``
and no MegaMoE kernel, expert-parallel experts (whole experts a rank) through FusedMoE's fallback
plus a replicated shared expert. Also prefill + decode under TP."""

from __future__ import annotations

from pathlib import Path

import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, reference_model, rel_err, token_ids, write_release
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

T = 140


def _load(model_dir: str, rank: int, world: int, a2a: str):  # type: ignore[no-untyped-def]
    from sglang.srt.models.loading import load_model

    return load_model(
        model_dir,
        LayerBuildSpec(
            dtype=torch.float32, tp_rank=rank, tp_size=world, moe_runner="torch", a2a_backend=a2a
        ),
        LoadOptions(progress=False),
    )


def _rank_logits(
    rank: int, world: int, model_dir: str, ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    import logging

    from sglang.srt.distributed import parallel_state as ps

    logging.getLogger("sglang").setLevel(logging.ERROR)  # the expected MegaMoE fallback warning
    ps.initialize_model_parallel(world)
    out = {}
    for a2a in ("none", "megamoe"):
        model = _load(model_dir, rank, world, a2a)
        out[a2a] = model(ids, torch.arange(ids.shape[0]))
    model = _load(model_dir, rank, world, "none")
    cache = model.new_request_cache()
    steps = [model.prefill(ids[:100], cache)]
    steps += [model.decode(ids[t : t + 1], [cache]) for t in range(100, ids.shape[0])]
    out["decode"] = torch.cat(steps)
    return out


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    hf = reference_model(CONFIG_A, seed=12)
    write_release(tmp_path, CONFIG_A, hf, dense="fp8")  # FP8 dense weights cut by rank
    ids = token_ids(T, CONFIG_A["vocab_size"], seed=13)
    single = _load(str(tmp_path), 0, 1, "none")(ids, torch.arange(T))
    ranks = run_distributed(_rank_logits, 2, str(tmp_path), ids, timeout_s=300)
    for rank, out in enumerate(ranks):
        for key, logits in out.items():
            err = rel_err(logits, single)
            print(f"rank {rank} {key}: rel max err vs TP=1 {err:.2e}")
            assert err < 1e-4, (rank, key, err)


if __name__ == "__main__":
    run_this_file(__file__)
