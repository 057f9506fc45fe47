"""Rotary embedding frequencies: DeepSeek V4's YaRN inverse frequencies equal transformers'."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config

from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling, rope_inv_freq
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=0.5)


def test_yarn_inv_freq_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV4Config(
        head_dim=128,
        qk_rope_head_dim=64,
        compress_rope_theta=160000.0,
        max_position_embeddings=1 << 20,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None, layer_type="compress")
    ours = rope_inv_freq(RopeSpec(64, 160000.0, YarnScaling(16.0, 65536)))
    assert factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


if __name__ == "__main__":
    run_this_file(__file__)
