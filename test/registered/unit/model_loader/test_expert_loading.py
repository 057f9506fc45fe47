"""Under ``--tp-size 4 --ep-size 2`` each rank's loader reads only its two MoE-TP group's experts
from a per-expert checkpoint (the other experts are never read, only counted as used) and keeps
only its half of each expert's intermediate dim, cut as stored: bf16 rows, and FP8 bytes with
their 128x128 block scales. The loaded part equals the same cut of the full experts, and the four
ranks together cover every expert row exactly once per MoE-TP group."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex
from sglang.srt.model_loader.expert_loading import load_layer_experts
from sglang.srt.model_loader.weight_source import as_weight_source
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

E, H, I, K = 8, 128, 256, 2  # FP8 blocks are 128: a half of I is one whole block row
TP, EP = 4, 2
PREFIX = "layers.0.experts"


def _checkpoint(fmt: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for e in range(E):
        for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t = torch.randn(*shape, generator=gen) * 0.1
            name = f"{PREFIX}.{e}.{w}.weight"
            if fmt == "fp8":
                q, s = block_quant_weight_fp8(t, (128, 128))
                out[name], out[f"{PREFIX}.{e}.{w}.scale"] = q, s
            else:
                out[name] = t.to(torch.bfloat16)
    return out


class _RecordingIndex(CheckpointIndex):
    """The index, remembering which tensors were read."""

    read: list[str]

    def get(self, canon: str) -> torch.Tensor:
        self.read.append(canon)
        return super().get(canon)


def _load_layer(index: CheckpointIndex, layer: FusedMoE) -> None:
    """Layer 0's routed experts (``.scale`` scales, fp32) into ``layer``."""
    load_layer_experts(
        index,
        layer,
        PREFIX,
        layer_id=0,
        scale_suffixes=lambda f: (".scale",),
        dtype=torch.float32,
        mega_weight_builder=None,
    )


def _load(ckpt: dict[str, torch.Tensor], rank: int) -> tuple[FusedMoE, _RecordingIndex]:
    base, _ = CheckpointIndex.build(as_weight_source(ckpt), lambda n: n)
    index = _RecordingIndex(base.source, base.by_canon, set())
    index.read = []
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="ep", ep_size=EP)
    layer = FusedMoE(config, tp_rank=rank, tp_size=TP)
    _load_layer(index, layer)
    return layer, index


def _expected(
    ckpt: dict[str, torch.Tensor], experts: range, inter: range, suffix: str, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ``w13`` (gate rows then up rows) and ``w2`` of ``experts``, cut to ``inter``
    (``step`` checkpoint rows / columns per stored row / column: 128 for FP8 scales)."""
    lo, hi = inter.start // step, inter.stop // step

    def t(e: int, w: str) -> torch.Tensor:
        return ckpt[f"{PREFIX}.{e}.{w}.{suffix}"]

    w13 = torch.stack([torch.cat([t(e, "w1")[lo:hi], t(e, "w3")[lo:hi]]) for e in experts])
    w2 = torch.stack([t(e, "w2")[:, lo:hi] for e in experts])
    return w13, w2


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_each_rank_reads_its_experts_and_keeps_its_slice(fmt: str) -> None:
    ckpt = _checkpoint(fmt)
    for rank in range(TP):
        layer, index = _load(ckpt, rank)
        ep_rank, moe_tp_rank = divmod(rank, TP // EP)
        experts = range(ep_rank * E // EP, (ep_rank + 1) * E // EP)
        half = I // (TP // EP)
        inter = range(moe_tp_rank * half, (moe_tp_rank + 1) * half)
        assert (layer.local_experts, layer.local_intermediate) == (experts, inter)
        # Only this rank's experts were read; the others count as used without a read.
        read = {int(name.split(".")[3]) for name in index.read}
        assert read == set(experts), (rank, sorted(read))
        index.check_all_used(strict=True, logger=logging.getLogger(__name__))
        w = layer.weights
        assert w is not None
        if fmt == "bf16":
            w13, w2 = _expected(ckpt, experts, inter, "weight", 1)
            torch.testing.assert_close(w.w13, w13.float(), rtol=0, atol=0)
            torch.testing.assert_close(w.w2, w2.float(), rtol=0, atol=0)
        else:  # FP8 stays FP8: the stored bytes and their block scales, cut
            assert w.is_fp8 and w.w13_scale is not None and w.w2_scale is not None
            w13, w2 = _expected(ckpt, experts, inter, "weight", 1)
            s13, s2 = _expected(ckpt, experts, inter, "scale", 128)
            assert torch.equal(w.w13.view(torch.uint8), w13.view(torch.uint8))
            assert torch.equal(w.w2.view(torch.uint8), w2.view(torch.uint8))
            torch.testing.assert_close(w.w13_scale, s13.float(), rtol=0, atol=0)
            torch.testing.assert_close(w.w2_scale, s2.float(), rtol=0, atol=0)


def test_fp8_slice_must_cover_whole_scale_blocks() -> None:
    """TP=8, EP=2: a quarter of I=256 is 64 rows, half a 128-row FP8 scale block."""
    from sglang.srt.model_loader.checkpoint_index import WeightLoadError

    ckpt = _checkpoint("fp8")
    index, _ = CheckpointIndex.build(as_weight_source(ckpt), lambda n: n)
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="ep", ep_size=2)
    layer = FusedMoE(config, tp_rank=5, tp_size=8)
    with pytest.raises(WeightLoadError, match=r"intermediate slice \(64 of 256\) divisible by 128"):
        _load_layer(index, layer)


if __name__ == "__main__":
    run_this_file(__file__)
