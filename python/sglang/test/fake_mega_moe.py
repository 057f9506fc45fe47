"""An MoE layer's MegaMoE path driven against the fake DeepGEMM, with its traffic recorded.

The model tests (DeepSeek V4's and Kimi K3's MoE blocks) check the same things about this path:
the order of DeepGEMM calls around the reserved-SM context, what the pre-dispatch staged, and
which all-reduces ran. :func:`install_fake_mega_moe` patches the engine onto a fake DeepGEMM and
an in-process "expert-parallel group" and returns the recorder those checks read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe import mega_moe, sm_budget
from sglang.srt.layers.moe.a2a import base as a2a_base
from sglang.srt.layers.moe.a2a import mega_moe_a2a
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.mega_moe_weights import (
    MegaWeights,
    build_mega_moe_experts_weights,
    ue8m0_to_float,
    unpack_ue8m0_words,
)
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4, quant_mxfp4
from sglang.srt.model_loader import mega_moe_prep
from sglang.srt.utils.device import DeviceSMInfo
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms, FakeMegaBuffer

if TYPE_CHECKING:
    import pytest

# What ``set_mega_weights`` needs to mark a layer ready; with these empty tensors the fake kernel
# only fills its output with 1.0 (tests of the call order). Real layouts: ``mxfp4_mega_experts``.
DUMMY_MEGA_WEIGHTS = ((torch.empty(0), torch.empty(0)), (torch.empty(0), torch.empty(0)))

_NUM_SMS = 132
_PRE_DISPATCH = mega_moe.mega_moe_pre_dispatch

# One MegaMoE forward on that device, as :meth:`MegaMoERecorder.call_order` lists it.
MEGA_CALL_ORDER: list[tuple[str, int]] = [
    ("get_symm_buffer_for_mega_moe", 132),  # buffer set-up on the original count
    ("pre_dispatch", 132),  # staged on the full SM count, outside the context
    ("set_num_sms", 130),
    ("fp8_fp4_mega_moe", 130),  # only the kernel runs narrowed
    ("set_num_sms", 132),
]


class MegaMoERecorder:
    def __init__(self, dg: FakeDeepGemmGemms) -> None:
        self.dg = dg
        self.all_reduces: list[torch.Tensor] = []
        self.staged: list[tuple[torch.Tensor, Any]] = []  # (rows handed over, symmetric buffer)

    def call_order(self) -> list[tuple[str, Any]]:
        """DeepGEMM's calls as ``(name, SM count at the call)``."""
        return [(n, v[0] if n == "fp8_fp4_mega_moe" else v) for n, v in self.dg.calls]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.all_reduces.append(x.clone())
        return x  # other ranks' partial sums are added by the test itself

    def pre_dispatch(self, original: Callable[..., None]) -> Callable[..., None]:
        def spy(
            x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, buf: Any, **kw: Any
        ) -> None:
            self.dg._record("pre_dispatch", self.dg.get_num_sms())
            self.staged.append((x.clone(), buf))
            original(x, ids, weights, buf, **kw)

        return spy


def install_fake_mega_moe(
    monkeypatch: pytest.MonkeyPatch,
    *,
    cap: int,
    all_reduce_modules: Sequence[ModuleType] = (),
    arch: int = 100,
) -> MegaMoERecorder:
    """A fake DeepGEMM on a 132-SM device of compute capability ``arch`` (sm_100 by default;
    90 for Hopper's ``fp8_mega_moe``), MegaMoE buffers of ``cap`` rows a rank, the pre-dispatch
    spied on, and ``tensor_model_parallel_all_reduce`` recorded in the a2a combine (the one MoE
    all-reduce) and in ``all_reduce_modules``."""
    monkeypatch.setenv(envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.name, str(cap))
    monkeypatch.delenv(envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.name, raising=False)
    mega_moe.clear_mega_moe_symm_buffers()
    dg = FakeDeepGemmGemms(num_sms=_NUM_SMS, arch=arch)
    rec = MegaMoERecorder(dg)
    monkeypatch.setattr(mega_moe_a2a, "get_deep_gemm", lambda: dg)
    # the loaders' post-load MegaMoE weight build sees the same fake
    monkeypatch.setattr(mega_moe_prep, "get_deep_gemm", lambda: dg)
    monkeypatch.setattr(mega_moe_a2a, "get_tp_group_or_none", lambda: "ep-group")
    device = lambda device=None: DeviceSMInfo(0, _NUM_SMS, (arch // 10, arch % 10))
    monkeypatch.setattr(mega_moe, "device_sm_info", device)
    monkeypatch.setattr(sm_budget, "device_sm_info", device)
    monkeypatch.setattr(
        mega_moe, "mega_moe_pre_dispatch", rec.pre_dispatch(mega_moe.mega_moe_pre_dispatch)
    )
    for mod in (a2a_base, *all_reduce_modules):
        monkeypatch.setattr(mod, "tensor_model_parallel_all_reduce", rec.all_reduce)
    return rec


def mxfp4_mega_experts(
    dg: FakeDeepGemmGemms, weights: ExpertWeights
) -> tuple[ExpertWeights, MegaWeights]:
    """``weights`` rounded to MXFP4: (the dequantised values, for the normal path; the same
    experts laid out for the MegaMoE kernel by ``build_mega_moe_experts_weights``)."""
    p13, s13 = quant_mxfp4(weights.w13)
    p2, s2 = quant_mxfp4(weights.w2)
    dtype = weights.w13.dtype
    rounded = ExpertWeights(dequant_mxfp4(p13, s13, dtype), dequant_mxfp4(p2, s2, dtype))
    return rounded, build_mega_moe_experts_weights(dg, p13, p2, s13, s2)


def fp8_staged(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the MegaMoE kernel sees it: through the engine's pre-dispatch (FP8 e4m3 with a
    UE8M0 scale per 32 values) and back to fp32."""
    t, hidden = x.shape
    buf = FakeMegaBuffer(
        x=torch.empty(t, hidden, dtype=torch.float8_e4m3fn),
        x_sf=torch.empty(t, hidden // 128, dtype=torch.int32),
        topk_idx=torch.empty(t, 1, dtype=torch.int64),
        topk_weights=torch.empty(t, 1),
    )
    # the unpatched function: a recorder's spy would log this as the layer's pre-dispatch
    _PRE_DISPATCH(x, torch.zeros(t, 1), torch.zeros(t, 1), buf, group_size=32)
    scales = ue8m0_to_float(unpack_ue8m0_words(buf.x_sf)).repeat_interleave(32, dim=-1)
    return buf.x.float() * scales
