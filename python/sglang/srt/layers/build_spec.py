"""How this rank builds its layers: one frozen value handed from the model down to every layer.

Every layer needs the same few facts (parameter dtype, device, this rank's place in the
tensor-parallel group, and for MoE blocks the runner and all-to-all backend names); passing them as
one typed object keeps constructors short and lets a new fact reach every layer without touching
each signature on the way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from sglang.srt.layers.quantization.dense_quant import DenseQuant

# The process group a spec's (tp_rank, tp_size) is a place in, and the one its row-parallel layers
# all-reduce over: the whole TP group, or (DP attention) this rank's attention-TP group.
TpGroupName = Literal["tp", "attn_tp"]


@dataclass(frozen=True)
class LayerBuildSpec:
    """``dtype`` is the dtype of the weights that run in the model dtype (fp32 parameters such as
    router biases stay fp32 whatever it is). ``moe_runner`` is a ``--moe-runner-backend`` name and
    ``a2a_backend`` a ``--moe-a2a-backend`` name; the MoE layer checks both. ``tp_group`` names
    the group ``(tp_rank, tp_size)`` are a place in (``"attn_tp"`` for attention under DP
    attention). ``moe_ep_size`` is ``--ep-size`` (None: the a2a backend's default).
    ``dense_quant``: how the checkpoint quantises this layer's dense weights (None: it does not);
    a model sets it only for the layers that ship quantised (:meth:`with_dense_quant`), never on
    the spec it builds everything from. ``kv_cache_dtype`` is a ``--kv-cache-dtype`` name."""

    dtype: torch.dtype = torch.bfloat16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_rank: int = 0
    tp_size: int = 1
    moe_runner: str = "auto"
    a2a_backend: str = "none"
    tp_group: TpGroupName = "tp"
    moe_ep_size: int | None = None
    dense_quant: DenseQuant | None = None
    # ``--kv-cache-dtype`` (the model resolves it for its caches); a model built without one
    # keeps its caches in the model dtype.
    kv_cache_dtype: str = "bf16"

    def __post_init__(self) -> None:
        # Callers may name the device as a string ("cuda:1"); layers compare torch.devices.
        object.__setattr__(self, "device", torch.device(self.device))
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a group of {self.tp_size} ranks")
        if self.tp_group not in ("tp", "attn_tp"):
            raise ValueError(f"tp_group must be 'tp' or 'attn_tp', got {self.tp_group!r}")

    def with_tp(
        self, tp_rank: int, tp_size: int, tp_group: TpGroupName | None = None
    ) -> LayerBuildSpec:
        """The same spec at another tensor-parallel place, e.g. the shared experts' under an
        expert-parallel backend (``(0, 1)``: replicated), or attention's within its
        attention-TP group (``tp_group="attn_tp"``). The group is kept unless given."""
        group = self.tp_group if tp_group is None else tp_group
        return dataclasses.replace(self, tp_rank=tp_rank, tp_size=tp_size, tp_group=group)

    def with_dense_quant(self, quant: DenseQuant | None) -> LayerBuildSpec:
        """The same spec for layers whose checkpoint weights are quantised as ``quant`` says
        (None: shipped in a float dtype)."""
        return dataclasses.replace(self, dense_quant=quant)

    def replicated(self) -> LayerBuildSpec:
        """The same spec for a layer every rank holds whole (a group of one)."""
        return self.with_tp(0, 1)


# What a model is built with when the caller says nothing: bf16 on the CPU, one rank.
DEFAULT_BUILD_SPEC = LayerBuildSpec()
