"""Kimi K3's latent MoE block.

For the normed FFN input ``x [T, H]``:
  s = sigmoid(x W_gate^T) (fp32, on the **full** hidden);  ids = top-k of s + bias;
  w = s[ids] / (sum + 1e-20) * routed_scaling_factor
  z = routed_expert_down_proj(x)                              [T, L]   (not normalised)
  y = sum_k w_k E_k(z),  E(z) = W2 SiTU(W1 z, W3 z)          [T, L]   (FusedMoE)
  out = routed_expert_up_proj(routed_expert_norm(y)) + shared_experts(x)
Without ``routed_expert_hidden_size`` the experts run on ``x`` and their sum is the routed output.

Reductions:
- normal path (``a2a_backend="none"``): experts are tensor-parallel over their intermediate dim,
  so each rank holds a *partial* latent sum; FusedMoE's a2a combine all-reduces it **before** the
  RMSNorm (norm(sum) != sum of norms), so no shared output joins that reduce. The up projection
  is replicated. Shared experts are tensor-parallel and reduce on their own (their down
  projection's row-parallel all-reduce).
- MegaMoE (``a2a_backend="megamoe"``, same :meth:`KimiK3MoE.forward`): experts are
  expert-parallel and the kernel returns combined latent rows, so no all-reduce precedes the norm;
  shared experts are replicated. :meth:`KimiK3MoE._forward_mega_experts` is the MegaMoE call site
  alone (the kernel, with activation "situ").
"""

from __future__ import annotations

from torch import Tensor, nn

from sglang.srt.layers.activation import SITU_BETA, SITU_LINEAR_BETA
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear, fp32_param
from sglang.srt.layers.moe.expert_plan import MegaKernelChoice
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.router import LinearRouter
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, select_experts
from sglang.srt.models.kimi_k3_config import ConfigError, KimiK3Config
from sglang.srt.models.kimi_k3_mlp import KimiK3MLP

# DeepGEMM's MegaMoE kernel stages the latent in 32-value FP8 groups with 16-byte scale rows and
# tiles the expert width by 128.
_MEGA_LATENT_MULTIPLE = 512
_MEGA_INTERMEDIATE_MULTIPLE = 128


class KimiK3Router(LinearRouter):
    """``weight [E, H]`` (model dtype) and, for ``noaux_tc``, ``e_score_correction_bias [E]``
    (fp32, steers selection only)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        spec: LayerBuildSpec,
        *,
        with_bias: bool,
    ) -> None:
        super().__init__(hidden_size, num_experts, spec)
        self.e_score_correction_bias: nn.Parameter | None = None
        if with_bias:
            self.e_score_correction_bias = fp32_param(num_experts, device=spec.device)


class KimiK3MoE(nn.Module):
    def __init__(self, config: KimiK3Config, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        self.latent = c.routed_expert_hidden_size
        activation = c.moe_activation
        if spec.a2a_backend == "megamoe":  # the MegaMoE kernel's shape rules, before any allocation
            _check_mega_shapes(c)
        self.gate = KimiK3Router(
            c.hidden_size, c.num_experts, spec, with_bias=c.use_correction_bias
        )
        self.topk_config = TopKConfig(
            top_k=c.num_experts_per_token,
            scoring_func=c.router_scoring,  # type: ignore[arg-type]
            renormalize=c.moe_renormalize,
            routed_scaling_factor=c.routed_scaling_factor,
            # folded into the weights, so every expert backend (MegaMoE included) sees final ones
            apply_routed_scaling=True,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
        )
        expert_hidden = c.hidden_size if self.latent is None else self.latent
        self.routed_expert_down_proj: ReplicatedLinear | None = None
        self.routed_expert_up_proj: ReplicatedLinear | None = None
        self.routed_expert_norm: RMSNorm | None = None
        if self.latent is not None:
            self.routed_expert_down_proj = ReplicatedLinear(c.hidden_size, self.latent, spec)
            self.routed_expert_up_proj = ReplicatedLinear(self.latent, c.hidden_size, spec)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(self.latent, c.rms_norm_eps, device=spec.device)
        self.experts = FusedMoE.from_spec(
            spec,
            num_experts=c.num_experts,
            hidden_size=expert_hidden,
            intermediate_size=c.moe_intermediate_size,
            top_k=c.num_experts_per_token,
            activation=activation,
        )
        self.shared_experts: KimiK3MLP | None = None
        if c.num_shared_experts:
            self.shared_experts = KimiK3MLP(
                c.hidden_size,
                c.moe_intermediate_size * c.num_shared_experts,
                self.experts.shared_expert_spec(spec),
                activation=activation,
            )

    def route(self, x: Tensor) -> TopKOutput:
        return select_experts(
            self.gate.logits(x), self.topk_config, self.gate.e_score_correction_bias
        )

    def _down(self, x: Tensor) -> Tensor:
        return x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)

    def _up(self, y: Tensor) -> Tensor:
        """The routed latent sum (already complete over ranks) -> hidden."""
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        return y if self.routed_expert_up_proj is None else self.routed_expert_up_proj(y)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, H]`` -> ``[T, H]``, complete (reduced over the TP group).

        Routing (fp32 logits, sigmoid + bias top-k) and the latent down projection, the shared
        experts, then the routed experts: a batch a MegaMoE kernel takes through the MegaMoE
        call site (:meth:`_forward_mega_experts`), every other in the experts' one call for every
        a2a backend. Tensor-parallel
        experts' partial latent sums are all-reduced inside it, before the norm; the MegaMoE
        kernel returns latent rows already combined over the expert-parallel group, so the norm
        follows with no all-reduce (the shared experts are replicated there)."""
        topk = self.route(x)
        z = self._down(x)
        # Before the experts: z is x itself without a latent, and an expert runner may write
        # its input in place.
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        kernel = self.experts.mega_kernel_for(z)
        if kernel is not None:
            routed = self._forward_mega_experts(z, topk, kernel)
        else:
            routed = self.experts(z, topk)
        out = self._up(routed)
        return out if shared is None else out + shared

    def _forward_mega_experts(
        self, z: Tensor, topk: TopKOutput, kernel: MegaKernelChoice
    ) -> Tensor:
        """Kimi K3's MegaMoE call site: the latent rows ``z [T, L]`` through the MegaMoE kernel
        alone with activation "situ" (``FusedMoE.forward_mega``: the symmetric buffer taken and
        the FP8 pre-dispatch run outside the reserved-SM context, only the kernel inside it),
        combined over the expert-parallel group, in ``z``'s dtype. DeepGEMM's SiTU kernel is
        SM100-only; on Hopper our Triton MegaMoE runs it. ``kernel`` is the choice
        ``FusedMoE.mega_kernel_for`` made for this batch (:meth:`forward` takes the runner where
        no MegaMoE kernel takes it)."""
        activation = self.experts.config.activation
        if activation != "situ":
            raise ValueError(f"Kimi K3's MegaMoE runs SiTU experts, not {activation!r}")
        return self.experts.forward_mega(z, topk, kernel)


def _check_mega_shapes(c: KimiK3Config) -> None:
    if c.hidden_act != "situ":
        # the kernel bakes in SiTU with beta=4, linear_beta=25 (the config parser accepts only
        # those)
        raise ConfigError(
            f"the Kimi K3 MegaMoE path needs hidden_act 'situ' (beta={SITU_BETA}, "
            f"linear_beta={SITU_LINEAR_BETA}), got {c.hidden_act!r}"
        )
    width = c.hidden_size if c.routed_expert_hidden_size is None else c.routed_expert_hidden_size
    if width % _MEGA_LATENT_MULTIPLE or c.moe_intermediate_size % _MEGA_INTERMEDIATE_MULTIPLE:
        raise ConfigError(
            f"MegaMoE needs the expert input width ({width}) divisible by "
            f"{_MEGA_LATENT_MULTIPLE} and "
            f"moe_intermediate_size ({c.moe_intermediate_size}) by {_MEGA_INTERMEDIATE_MULTIPLE}"
        )
