"""The registry of MoE runners: ``torch`` (reference, CPU), ``triton``, ``deep_gemm``."""

from __future__ import annotations

from sglang.srt.layers.moe.moe_runner.base import MoERunConfig, MoERunner
from sglang.srt.utils.registry import Registry

MOE_RUNNERS: Registry[MoERunner] = Registry("MoE runner backend")


@MOE_RUNNERS.register("torch")
def _torch(config: MoERunConfig) -> MoERunner:
    from sglang.srt.layers.moe.moe_runner.torch_runner import TorchMoERunner

    return TorchMoERunner(config)


@MOE_RUNNERS.register("triton")
def _triton(config: MoERunConfig) -> MoERunner:
    from sglang.srt.layers.moe.moe_runner.triton_runner import TritonMoERunner

    return TritonMoERunner(config)


@MOE_RUNNERS.register("deep_gemm")
def _deep_gemm(config: MoERunConfig) -> MoERunner:
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner

    return DeepGemmMoERunner(config)


def create_moe_runner(name: str, config: MoERunConfig) -> MoERunner:
    return MOE_RUNNERS.create(name, config)
