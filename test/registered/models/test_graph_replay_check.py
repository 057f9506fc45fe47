"""The graph tests' shared decode check (``sglang.test.graph_replay_check``) on CPU: the built-in
DeepSeek V4 model in fp32 with its slot pool, the "replay" being the static decode itself (so
replay == eager static holds by construction here; on the GPU it is a CUDA graph). The check
runs every request's three caches, follows the routing, frees what it took, and fails when the
replay differs from the eager static decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models import deepseek_v4_moe
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.srt.models.static_step import pad_rows
from sglang.test.ci_register import register_cpu_ci
from sglang.test.decode_drift import RouteFollower
from sglang.test.graph_replay_check import check_replay_against_static_and_reference
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)

VOCAB = 512
LENGTHS = (5, 40, 11)


@dataclass
class EagerGraphs:
    """Stands in for a CudaGraphRunner: ``replay`` runs the static decode (or a broken one)."""

    model: Any
    offset: float = 0.0

    def padded_size(self, bs: int) -> int:
        return 1 << max(0, bs - 1).bit_length()

    def replay(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """As a replay does: pads to the captured size with the scratch slot, returns real rows."""
        bs = ids.shape[0]
        pool = self.model.slot_pool
        padded = pad_rows(ids, pos, slots, self.padded_size(bs), pool.scratch_slot)
        return self.model.static_decode(*padded)[:bs] + self.offset


def _model() -> DeepseekV4ForCausalLM:
    raw = default_model_config(VOCAB, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw), LayerBuildSpec(dtype=torch.float32, device="cpu")
    )
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=9, capacity=256, block_tokens=128)
    return model


def _seqs(bs: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(bs)
    return [torch.randint(0, VOCAB, (n + steps,), generator=g) for n in LENGTHS[:bs]]


@torch.no_grad()
def test_check_passes_and_frees_its_caches() -> None:
    model = _model()
    pool = model.slot_pool
    assert pool is not None
    with RouteFollower(deepseek_v4_moe) as routes:
        check_replay_against_static_and_reference(
            model, EagerGraphs(model), _seqs(3, 6), LENGTHS, 6, routes
        )
    assert routes.gaps == []  # fp32: the paths agree to rounding, no router flips
    assert pool.num_free == pool.max_slots
    assert pool.block_pool.num_free == pool.block_pool.num_blocks


@torch.no_grad()
def test_check_fails_when_replay_differs() -> None:
    model = _model()
    with pytest.raises(AssertionError):
        check_replay_against_static_and_reference(
            model, EagerGraphs(model, offset=1e-3), _seqs(1, 2), LENGTHS, 2
        )


if __name__ == "__main__":
    run_this_file(__file__)
