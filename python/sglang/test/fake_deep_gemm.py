"""A stand-in for the DeepGEMM module that records how the engine drives it.

DeepGEMM's kernels cannot run on every machine (its wheels are built for one torch), so the call
sites are tested against this fake: it keeps a process-wide SM count like the real module and
logs every call in order.
"""

from __future__ import annotations

import threading
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
    buffer_uses_num_sms: bool = True
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def MEGA_MOE_BUFFER_USES_NUM_SMS(self) -> bool:
        return self.buffer_uses_num_sms

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

    def get_symm_buffer_for_mega_moe(self, *args: Any, **kwargs: Any) -> FakeSymmBuffer:
        self._record("get_symm_buffer_for_mega_moe", self.num_sms)
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


class FakeDeepGemmGemms(FakeDeepGemm):
    """Adds DeepGEMM's grouped GEMMs and MegaMoE entry points, computed in torch, so runner
    layouts (contiguous ``m_indices``, masked ``masked_m``) are checked for real."""

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

    def m_grouped_bf16_gemm_nt_contiguous(self, a: Any, w: Any, out: Any, m_indices: Any) -> None:
        self._record("m_grouped_bf16_gemm_nt_contiguous", self.num_sms)
        self._contiguous(a, w, out, m_indices)

    def m_grouped_fp8_gemm_nt_contiguous(self, a: Any, w: Any, out: Any, m_indices: Any) -> None:
        self._record("m_grouped_fp8_gemm_nt_contiguous", self.num_sms)
        self._contiguous(a, w, out, m_indices)

    def m_grouped_bf16_gemm_nt_masked(self, a: Any, w: Any, out: Any, masked_m: Any, expected_m: int) -> None:
        self._record("m_grouped_bf16_gemm_nt_masked", self.num_sms)
        self._masked(a, w, out, masked_m, expected_m)

    def m_grouped_fp8_gemm_nt_masked(self, a: Any, w: Any, out: Any, masked_m: Any, expected_m: int) -> None:
        self._record("m_grouped_fp8_gemm_nt_masked", self.num_sms)
        self._masked(a, w, out, masked_m, expected_m)

    # MegaMoE: the fake kernel records the SM count it ran with. Given built weights it computes
    # the routed experts from the transformed layout; given placeholder (empty) weights it only
    # fills the output with 1.0, for the tests that check the call order alone.
    def fp8_fp4_mega_moe(self, y: Any, l1: Any, l2: Any, buf: Any, **kwargs: Any) -> None:
        self._record("fp8_fp4_mega_moe", (self.num_sms, kwargs))
        if l1[0].numel() == 0:
            y.fill_(1.0)
            return
        from sglang.test.fake_mega_moe_kernel import reference_mega_moe

        reference_mega_moe(
            y, l1, l2, buf, activation=kwargs.get("activation", "swiglu"),
            activation_clamp=kwargs.get("activation_clamp"),
        )  # fmt: skip

    def transform_sf_into_required_layout(self, sf: Any, mn: int, k: int, **kwargs: Any) -> Any:
        from sglang.test.fake_mega_moe_kernel import fake_transform_sf_into_required_layout

        self._record("transform_sf_into_required_layout", (tuple(sf.shape), mn, k))
        return fake_transform_sf_into_required_layout(sf, mn, k, **kwargs)

    def fp8_mega_moe(self, y: Any, l1: Any, l2: Any, buf: Any, **kwargs: Any) -> None:
        self._record("fp8_mega_moe", (self.num_sms, kwargs))
        y.fill_(2.0)

    def mega_moe_pre_dispatch_sm90(self, *args: Any, **kwargs: Any) -> None:
        self._record("mega_moe_pre_dispatch_sm90", self.num_sms)

    def get_symm_buffer_for_mega_moe(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        self._record("get_symm_buffer_for_mega_moe", self.num_sms)
        _, num_experts, cap, topk, hidden, _inter = args
        return FakeMegaBuffer(
            x=torch.full((cap, hidden), float("nan")).to(torch.float8_e4m3fn),
            x_sf=torch.full((cap, hidden // 128), -7, dtype=torch.int32),
            topk_idx=torch.full((cap, topk), 99, dtype=torch.int64),
            topk_weights=torch.full((cap, topk), 5.0),
            num_experts=num_experts,
        )


@dataclass
class FakeMegaBuffer:
    x: Any
    x_sf: Any
    topk_idx: Any
    topk_weights: Any
    num_experts: int | None = None  # over the whole group, as DeepGEMM's buffer records it
