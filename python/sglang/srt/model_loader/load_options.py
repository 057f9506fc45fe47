"""How a checkpoint is read into a model that is already built (the build itself is the model's
:class:`~sglang.srt.layers.build_spec.LayerBuildSpec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the MoE stack is not imported to name a type (the registry stays cheap)
    from sglang.srt.model_loader.mega_moe_prep import MegaWeightBuilder


@dataclass(frozen=True)
class LoadOptions:
    """``strict``: a checkpoint tensor nothing asks for is an error (else a warning).
    ``progress``: show the progress bar (rank 0 only, in the server). ``mega_weight_builder``: how
    expert-parallel layers get their MegaMoE weights (default: DeepGEMM's layout when usable)."""

    strict: bool = True
    progress: bool = True
    mega_weight_builder: MegaWeightBuilder | None = None


DEFAULT_LOAD_OPTIONS = LoadOptions()
