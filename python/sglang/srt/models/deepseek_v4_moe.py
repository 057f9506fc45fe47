"""DeepSeek V4 MoE block: router (sqrtsoftplus + bias top-k, or hash routing by token id), routed
experts through :class:`FusedMoE`, one shared expert, ``routed_scaling_factor``.

``out = routed_scaling_factor * sum_k w_k E_k(x) + shared(x)``; the scaling is folded into the
top-k weights, so every expert backend (and the MegaMoE kernel) sees final weights.

Reductions (all before the caller's mHC post) are the a2a backend's combine, never this block's:
- ``a2a_backend="none"``: experts and shared expert are tensor-parallel over the intermediate dim;
  the shared partial sum is handed to the combine, which adds it in place into the routed partial
  sum and all-reduces the two once.
- ``a2a_backend="megamoe"`` or ``"ep"``: experts are expert-parallel and FusedMoE returns this
  rank's rows fully combined (the MegaMoE kernel combines over the group, its fallback's combine
  all-reduces; ``ep``'s combine brings the all-to-all results back and all-gathers the rows), so
  the shared expert is replicated (full weights, local rows) and added after the combine.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import WeightShapeError, attach_loader, fp32_param
from sglang.srt.layers.mlp import gated_mlp_forward, gated_mlp_projections
from sglang.srt.layers.moe.expert_plan import MegaKernelChoice
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.router import LinearRouter
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, hash_select_experts, select_experts
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig


class SharedExpertMLP(nn.Module):
    """Clamped SwiGLU MLP: ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``; w1/w3 column-parallel,
    w2 row-parallel *without* its own all-reduce (the MoE block reduces once)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        spec: LayerBuildSpec,
        *,
        swiglu_limit: float | None,
    ) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = gated_mlp_projections(
            hidden_size, intermediate_size, spec, reduce_results=False
        )
        self.swiglu_limit = swiglu_limit
        # Opt-in: the activation writes w2's FP8 input (SGLANG_FP8_FUSED_ACT_QUANT).
        self.fuse_act_quant = envs.SGLANG_FP8_FUSED_ACT_QUANT.get() and self.w2.fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp_forward(
            x,
            self.w1,
            self.w3,
            self.w2,
            "swiglu",
            swiglu_limit=self.swiglu_limit,
            fuse_act_quant=self.fuse_act_quant,
        )


class MoEGate(LinearRouter):
    """Router weight ``[E, H]``; ``bias [E]`` (fp32, selection only) on normal layers or the
    ``tid2eid [vocab, top_k]`` table on hash layers."""

    tid2eid: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        spec: LayerBuildSpec,
        *,
        hash_vocab: int | None,
        top_k: int,
    ) -> None:
        super().__init__(hidden_size, num_experts, spec)
        self.is_hash = hash_vocab is not None
        self.bias: nn.Parameter | None = None
        if hash_vocab is None:
            self.bias = fp32_param(num_experts, device=spec.device)
        else:
            table = torch.zeros(hash_vocab, top_k, dtype=torch.int32, device=spec.device)
            self.register_buffer("tid2eid", table)
            # An integer table, no parameter: the checkpoint loop fills it through this loader.
            attach_loader(self.tid2eid, lambda _table, full: self.load_tid2eid(full))

    def load_tid2eid(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != tuple(self.tid2eid.shape):
            raise WeightShapeError(
                f"expected shape {tuple(self.tid2eid.shape)}, got {tuple(full.shape)}"
            )
        if full.dtype.is_floating_point:
            raise WeightShapeError(f"tid2eid must be an integer tensor, got {full.dtype}")
        self.tid2eid.copy_(full.to(torch.int32))


class DeepseekV4MoE(nn.Module):
    def __init__(self, config: DeepseekV4ModelConfig, layer_id: int, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.tp_rank, self.tp_size = spec.tp_rank, spec.tp_size
        self.is_hash = c.hash_layers[layer_id]
        self.gate = MoEGate(
            c.hidden_size,
            c.n_routed_experts,
            spec,
            hash_vocab=c.vocab_size if self.is_hash else None,
            top_k=c.num_experts_per_tok,
        )
        self.topk_config = TopKConfig(
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,  # type: ignore[arg-type]
            renormalize=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            apply_routed_scaling=True,
        )
        self.experts = FusedMoE.from_spec(
            spec,
            num_experts=c.n_routed_experts,
            hidden_size=c.hidden_size,
            intermediate_size=c.moe_intermediate_size,
            top_k=c.num_experts_per_tok,
            activation="swiglu",
            swiglu_limit=c.swiglu_limit,
        )
        self.shared_experts: SharedExpertMLP | None = None
        if c.n_shared_experts:
            self.shared_experts = SharedExpertMLP(
                c.hidden_size,
                c.moe_intermediate_size * c.n_shared_experts,
                self.experts.shared_expert_spec(spec).with_dense_quant(c.dense_quant),
                swiglu_limit=c.swiglu_limit,
            )

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> TopKOutput:
        logits = self.gate.logits(x)
        if self.is_hash:
            return hash_select_experts(input_ids, self.gate.tid2eid, logits, self.topk_config)
        return select_experts(logits, self.topk_config, self.gate.bias)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``input_ids [T]`` (the token id of every row: hash layers route by it)
        -> ``[T, H]``, complete (reduced over the TP group). A batch a MegaMoE kernel takes goes
        through the MegaMoE call site; every other batch takes the experts' one call for every
        a2a backend: the shared partial sum joins the routed one in the combine (``none``) or is
        added after it (expert-parallel backends)."""
        # Shared expert before the experts: an in-place expert runner may overwrite x.
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        kernel = self.experts.mega_kernel_for(x)
        if kernel is not None:
            return self._run_mega_routed(x, input_ids, shared, kernel)
        return self.experts(x, self.route(x, input_ids), shared=shared)

    def _run_mega_routed(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        shared: torch.Tensor | None,
        kernel: MegaKernelChoice,
    ) -> torch.Tensor:
        """DeepSeek V4's MegaMoE call site: route, then the MegaMoE ``kernel`` that
        ``FusedMoE.mega_kernel_for`` chose for this batch alone on the routed experts
        (``FusedMoE.forward_mega``: DeepGEMM's ``fp8_mega_moe`` / ``fp8_fp4_mega_moe`` with the
        pre-dispatch into its symmetric buffer outside the reserved-SM context and only the
        kernel inside it, or our Triton persistent kernel), plus the replicated ``shared``
        expert; no further reduction. :meth:`forward` takes the runner where no MegaMoE kernel
        takes the batch."""
        topk = self.route(x, input_ids)
        out = self.experts.forward_mega(x, topk, kernel)
        return out if shared is None else out + shared
