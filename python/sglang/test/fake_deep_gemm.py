"""A stand-in for the DeepGEMM module that records how the engine drives it.

DeepGEMM's kernels cannot run on every machine (its wheels are built for one torch, and need a
GPU), so the call sites are tested on CPU against this fake: it keeps a process-wide SM count like
the real module and logs every call in order. Its public functions carry the names and
signatures of sgl-deep-gemm 0.1.5.post1; ``test_deep_gemm_adapter_gpu.py`` checks them against the
real module on the H200, so the fake cannot drift from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeSymmBuffer:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    num_sms_at_creation: int


@dataclass
class FakeDeepGemm:
    num_sms: int = 132
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    __version__: str = "0.1.5.post1"

    def _record(self, name: str, value: Any = None) -> None:
        with self._lock:
            self.calls.append((name, value))

    def get_num_sms(self) -> int:
        return self.num_sms

    def set_num_sms(self, value: int) -> None:
        self._record("set_num_sms", value)
        self.num_sms = value

    def set_calls(self) -> list[int]:
        return [value for name, value in self.calls if name == "set_num_sms"]

    def get_symm_buffer_for_mega_moe(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        use_fp8_dispatch: bool | None = None,
        mma_type: str = "fp8xfp4",
        activation: str = "swiglu",
    ) -> Any:
        self._record("get_symm_buffer_for_mega_moe", self.num_sms)
        args = (group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
        return self._symm_buffer(args, {"mma_type": mma_type, "activation": activation})

    def _symm_buffer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The buffer for ``get_symm_buffer_for_mega_moe``'s positional ``args`` and keyword
        ``kwargs``: here what it was asked for and the SM count then."""
        return FakeSymmBuffer(args, kwargs, self.num_sms)


def _dequant_act(a: Any) -> Any:
    """(fp8 [..., K], scale [..., K/128]) or a bf16 tensor -> fp32."""
    if isinstance(a, tuple):
        q, s = a
        return q.float() * s.float().repeat_interleave(128, dim=-1)[..., : q.shape[-1]]
    return a.float()


def _dequant_weight(w: Any) -> Any:
    """(fp8 [E, N, K], block scale [E, N/128, K/128]) or bf16 [E, N, K] -> fp32."""
    if isinstance(w, tuple):
        q, s = w
        full = s.float().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return q.float() * full[:, : q.shape[1], : q.shape[2]]
    return w.float()


def _mega_moe_entry(name: str, default_recipe: tuple[int, int, int]) -> Callable[..., None]:
    """A MegaMoE entry point as DeepGEMM has it: Blackwell's ``fp8_fp4_mega_moe`` and Hopper's
    ``fp8_mega_moe`` take the same arguments, each with its own default recipe."""

    def entry(
        self: FakeDeepGemmGemms,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        cumulative_local_expert_recv_stats: Any = None,
        recipe: Any = default_recipe,
        activation: str = "swiglu",
        activation_clamp: float | None = None,
        fast_math: bool = True,
    ) -> None:
        self._mega_call(
            name, y, l1_weights, l2_weights, sym_buffer, recipe, activation, activation_clamp,
            fast_math,
        )  # fmt: skip

    entry.__name__ = name
    entry.__qualname__ = f"FakeDeepGemmGemms.{name}"
    return entry


class FakeDeepGemmGemms(FakeDeepGemm):
    """Adds DeepGEMM's grouped GEMMs and MegaMoE entry points, computed in torch, so runner
    layouts (contiguous ``grouped_layout``, masked ``masked_m``) are checked for real. ``arch``
    is the compute capability the fake pretends to run on (its MegaMoE buffer differs)."""

    def __init__(self, num_sms: int = 132, arch: int = 100) -> None:
        super().__init__(num_sms=num_sms)
        self.arch = arch

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return 128

    def _contiguous(self, a: Any, w: Any, out: Any, m_indices: Any) -> None:
        lhs, rhs = _dequant_act(a), _dequant_weight(w)
        for row in range(lhs.shape[0]):
            e = int(m_indices[row])
            if e >= 0:
                out[row] = (lhs[row] @ rhs[e].T).to(out.dtype)

    def _masked(self, a: Any, w: Any, out: Any, masked_m: Any, expected_m: int) -> None:
        lhs, rhs = _dequant_act(a), _dequant_weight(w)
        for e in range(lhs.shape[0]):
            m = int(masked_m[e])
            out[e, :m] = (lhs[e, :m] @ rhs[e].T).to(out.dtype)

    def fp8_fp4_gemm_nt(
        self,
        a: Any,
        b: Any,
        d: Any,
        c: Any = None,
        recipe: Any = None,
        recipe_a: Any = None,
        recipe_b: Any = None,
        compiled_dims: str = "",
        disable_ue8m0_cast: bool = False,
    ) -> None:
        """The SM90 dense FP8 GEMM ``d = a @ b^T`` as the real one takes it: ``(fp8 [M, K],
        fp32 [M, ceil(K/128)])`` and ``(fp8 [N, K], fp32 [ceil(N/128), ceil(K/128)])``, both
        K-major, ``d`` bf16 ``[M, N]`` with contiguous rows, no ``c``. Records whether the
        activation scales arrived MN-major and 16-byte aligned (the layout the real one reads;
        any other it copies into it first)."""
        import torch

        (aq, sfa), (bq, sfb) = a, b
        m, k = aq.shape
        n = bq.shape[0]
        kb = -(-k // 128)
        assert aq.dtype == bq.dtype == torch.float8_e4m3fn, (aq.dtype, bq.dtype)
        assert aq.stride(-1) == 1 and bq.stride(-1) == 1, "A and B must be K-major"
        assert c is None and d.dtype == torch.bfloat16 and tuple(d.shape) == (m, n)
        assert d.stride(-1) == 1 and bq.shape[1] == k
        assert sfa.dtype == sfb.dtype == torch.float32
        assert tuple(sfa.shape) == (m, kb) and tuple(sfb.shape) == (-(-n // 128), kb)
        assert sfb.is_contiguous() or sfb.t().is_contiguous(), "SM90 SFB must be contiguous"
        aligned = -(-m // 4) * 4
        mn_major = (sfa.stride(0) == 1 or m == 1) and (sfa.stride(1) == aligned or kb == 1)
        self._record("fp8_fp4_gemm_nt", {"num_sms": self.num_sms, "sfa_copied": not mn_major})
        lhs = _dequant_act((aq, sfa))
        rhs = _dequant_weight((bq.unsqueeze(0), sfb.unsqueeze(0)))[0]
        d.copy_((lhs @ rhs.T).to(d.dtype))

    fp8_gemm_nt = fp8_fp4_gemm_nt

    def m_grouped_bf16_gemm_nt_contiguous(
        self,
        a: Any,
        b: Any,
        d: Any,
        grouped_layout: Any,
        compiled_dims: str = "nk",
        use_psum_layout: bool = False,
        ensure_zero_padding: bool = True,
        expected_m_for_psum_layout: Any = None,
    ) -> None:
        self._record("m_grouped_bf16_gemm_nt_contiguous", self.num_sms)
        self._contiguous(a, b, d, grouped_layout)

    def m_grouped_fp8_fp4_gemm_nt_contiguous(
        self,
        a: Any,
        b: Any,
        d: Any,
        grouped_layout: Any,
        recipe: Any = None,
        recipe_a: Any = None,
        recipe_b: Any = None,
        compiled_dims: str = "nk",
        disable_ue8m0_cast: bool = False,
        use_psum_layout: bool = False,
        ensure_zero_padding: bool = True,
        expected_m_for_psum_layout: Any = None,
    ) -> None:
        self._record("m_grouped_fp8_fp4_gemm_nt_contiguous", self.num_sms)
        self._contiguous(a, b, d, grouped_layout)

    m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous

    def m_grouped_bf16_gemm_nt_masked(
        self, a: Any, b: Any, d: Any, masked_m: Any, expected_m: int, compiled_dims: str = "nk"
    ) -> None:
        self._record("m_grouped_bf16_gemm_nt_masked", self.num_sms)
        self._masked(a, b, d, masked_m, expected_m)

    def m_grouped_fp8_fp4_gemm_nt_masked(
        self,
        a: Any,
        b: Any,
        d: Any,
        masked_m: Any,
        expected_m: int,
        recipe: Any = None,
        recipe_a: Any = None,
        recipe_b: Any = None,
        compiled_dims: str = "nk",
        disable_ue8m0_cast: bool = False,
    ) -> None:
        self._record("m_grouped_fp8_fp4_gemm_nt_masked", self.num_sms)
        self._masked(a, b, d, masked_m, expected_m)

    fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked

    # MegaMoE: the fake kernel records the SM count it ran with. Given built weights it computes
    # the routed experts from the transformed layout; given placeholder (empty) weights it only
    # fills the output (1.0 Blackwell's, 2.0 Hopper's), for the tests that check the call order.
    def _mega_call(
        self,
        name: str,
        y: Any,
        l1_weights: Any,
        l2_weights: Any,
        sym_buffer: Any,
        recipe: Any,
        activation: str,
        activation_clamp: float | None,
        fast_math: bool,
    ) -> None:
        kwargs = {"recipe": recipe, "activation": activation, "fast_math": fast_math}
        if activation_clamp is not None:
            kwargs["activation_clamp"] = activation_clamp
        self._record(name, (self.num_sms, kwargs))
        blackwell = name == "fp8_fp4_mega_moe"
        if l1_weights[0].numel() == 0:
            y.fill_(1.0 if blackwell else 2.0)
        elif blackwell:
            from sglang.test.fake_mega_moe_kernel import reference_mega_moe

            reference_mega_moe(
                y,
                l1_weights,
                l2_weights,
                sym_buffer,
                activation=activation,
                activation_clamp=activation_clamp,
            )
        else:
            from sglang.test.fake_mega_moe_kernel import reference_sm90_mega_moe

            reference_sm90_mega_moe(
                y, l1_weights, l2_weights, sym_buffer, activation_clamp=activation_clamp
            )

    fp8_fp4_mega_moe = _mega_moe_entry("fp8_fp4_mega_moe", (1, 1, 32))
    fp8_mega_moe = _mega_moe_entry("fp8_mega_moe", (128, 128, 128))

    def transform_sf_into_required_layout(
        self,
        sf: Any,
        mn: int,
        k: int,
        recipe: Any,
        num_groups: int | None = None,
        is_sfa: bool | None = None,
        disable_ue8m0_cast: bool = False,
    ) -> Any:
        from sglang.test.fake_mega_moe_kernel import fake_transform_sf_into_required_layout

        self._record("transform_sf_into_required_layout", (tuple(sf.shape), mn, k))
        return fake_transform_sf_into_required_layout(
            sf, mn, k, recipe=recipe, num_groups=num_groups, is_sfa=is_sfa
        )

    def transform_weights_for_mega_moe_sm90(self, l1_weights: Any, l2_weights: Any) -> Any:
        from sglang.srt.layers.moe.mega_moe_weights import interleave_gate_up

        self._record("transform_weights_for_mega_moe_sm90", None)
        return (interleave_gate_up(l1_weights[0]), l1_weights[1]), l2_weights

    def mega_moe_pre_dispatch_sm90(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        buf_x: Any,
        buf_x_sf: Any,
        buf_topk_idx: Any,
        buf_topk_weights: Any,
        num_tokens: int,
        group_size: int = 128,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        """As the real kernel: bf16 x, int32 ids; fp32 scale ``max(amax, 1e-10) / 448`` per 128
        values; ids widened to int64; rows past ``num_tokens`` get id -1, weight 0."""
        import torch

        self._record("mega_moe_pre_dispatch_sm90", self.num_sms)
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == torch.int32 and group_size == 128
        hidden = x.shape[1]
        groups = x[:num_tokens].float().view(num_tokens, hidden // 128, 128)
        scale = groups.abs().amax(-1).clamp_min(1e-10) / 448.0
        buf_x[:num_tokens] = (groups / scale.unsqueeze(-1)).view(num_tokens, hidden).to(buf_x.dtype)
        buf_x_sf[:num_tokens] = scale
        buf_topk_idx[:num_tokens] = topk_idx[:num_tokens].long()
        buf_topk_weights[:num_tokens] = topk_weights[:num_tokens] * routed_scaling_factor
        buf_topk_idx[num_tokens:] = -1
        buf_topk_weights[num_tokens:] = 0.0

    def _symm_buffer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Staging tensors the pre-dispatch kernel fills, poisoned (NaN rows, id 99, weight 5)."""
        import torch

        _, num_experts, cap, num_topk, hidden, _ = args
        # Hopper stages fp32 scales per 128 values; Blackwell packs four UE8M0 bytes an int32.
        x_sf = (
            torch.full((cap, hidden // 128), -7.0)
            if self.arch < 100
            else torch.full((cap, hidden // 128), -7, dtype=torch.int32)
        )
        return FakeMegaBuffer(
            x=torch.full((cap, hidden), float("nan")).to(torch.float8_e4m3fn),
            x_sf=x_sf,
            topk_idx=torch.full((cap, num_topk), 99, dtype=torch.int64),
            topk_weights=torch.full((cap, num_topk), 5.0),
            num_experts=num_experts,
        )


@dataclass
class FakeMegaBuffer:
    x: Any
    x_sf: Any
    topk_idx: Any
    topk_weights: Any
    num_experts: int | None = None  # over the whole group, as DeepGEMM's buffer records it
