"""The registry of MoE a2a backends (``--moe-a2a-backend``): ``none`` (tensor parallel, one
all-reduce) and ``megamoe`` (DeepGEMM's fused dispatch + experts + combine). A new backend is
a file with a :class:`MoEA2ABackend` subclass and one entry here."""

from __future__ import annotations

import torch

from sglang.srt.layers.moe.a2a.base import MoEA2ABackend
from sglang.srt.layers.moe.fused_moe_config import FusedMoEConfig
from sglang.srt.utils.registry import Registry

MOE_A2A_BACKENDS: Registry[MoEA2ABackend] = Registry("MoE a2a backend")


@MOE_A2A_BACKENDS.register("none")
def _tensor_parallel(
    config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
) -> MoEA2ABackend:
    from sglang.srt.layers.moe.a2a.tensor_parallel import TensorParallelA2A

    return TensorParallelA2A(config, tp_rank=tp_rank, tp_size=tp_size, device=device)


@MOE_A2A_BACKENDS.register("megamoe")
def _mega_moe(
    config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
) -> MoEA2ABackend:
    from sglang.srt.layers.moe.a2a.mega_moe_a2a import MegaMoEA2A

    return MegaMoEA2A(config, tp_rank=tp_rank, tp_size=tp_size, device=device)


def create_a2a_backend(
    config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
) -> MoEA2ABackend:
    """The backend ``config.a2a_backend`` names, for one layer on this rank."""
    return MOE_A2A_BACKENDS.create(
        config.a2a_backend, config, tp_rank=tp_rank, tp_size=tp_size, device=device
    )
