"""Gated activations (clamped SwiGLU, SiTU) against float64 formulas written out with math."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from sglang.srt.layers import activation as act_mod
from sglang.srt.layers.activation import ACTIVATIONS, act_and_mul, situ_torch, swiglu_torch
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

KERNEL_MODULE = "sglang.kernels.ops.activation"


# --- float64 references, element by element -----------------------------------------------------


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x)) if x > -700 else 0.0


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


def _ref_swiglu(gate_up: torch.Tensor, limit: float | None) -> np.ndarray:
    x = gate_up.double().numpy()
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]

    def one(g: float, u: float) -> float:
        if limit is not None:
            g = min(g, limit)
            u = max(-limit, min(u, limit))
        return _silu(g) * u

    return np.vectorize(one)(gate, up)


def _ref_situ(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> np.ndarray:
    x = gate_up.double().numpy()
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]

    def one(g: float, u: float) -> float:
        g2 = beta * math.tanh(g / beta) * _sigmoid(g)
        u2 = u if linear_beta is None else linear_beta * math.tanh(u / linear_beta)
        return g2 * u2

    return np.vectorize(one)(gate, up)


def _inputs(shape: tuple[int, ...], seed: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _assert_close(out: torch.Tensor, ref: np.ndarray, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert tuple(out.shape) == ref.shape
    if dtype == torch.float32:
        np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-6)
    else:
        # The fp32 result is rounded once to bf16: within one bf16 ulp (2^-8 relative).
        np.testing.assert_allclose(out.double().numpy(), ref, rtol=2**-8, atol=1e-6)


# --- swiglu --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 7.0, 0.5])
def test_swiglu_matches_reference(dtype: torch.dtype, limit: float | None) -> None:
    x = _inputs((3, 5, 2 * 48), seed=1, scale=4.0, dtype=dtype)
    _assert_close(swiglu_torch(x, limit), _ref_swiglu(x, limit), dtype)


def test_swiglu_clamp_at_large_magnitudes() -> None:
    limit = 7.0
    gate = torch.tensor([50.0, -50.0, 3.0, 1000.0, -3.0])
    up = torch.tensor([2.0, 2.0, -100.0, 100.0, 9.5])
    out = swiglu_torch(torch.cat([gate, up]).unsqueeze(0), limit)[0].double()
    want = [
        _silu(7.0) * 2.0,
        _silu(-50.0) * 2.0,
        _silu(3.0) * -7.0,
        _silu(7.0) * 7.0,
        _silu(-3.0) * 7.0,
    ]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-12)
    # Without the limit the same inputs pass through unclamped.
    free = swiglu_torch(torch.cat([gate, up]).unsqueeze(0))[0].double()
    assert free[0].item() == pytest.approx(_silu(50.0) * 2.0, rel=1e-6)
    assert free[3].item() == pytest.approx(1000.0 * 100.0, rel=1e-6)


def test_swiglu_limit_bounds_output() -> None:
    limit = 10.0
    x = _inputs((64, 256), seed=2, scale=100.0, dtype=torch.bfloat16)
    out = swiglu_torch(x, limit).float()
    assert out.abs().max().item() <= _silu(limit) * limit * (1 + 2**-8)
    assert swiglu_torch(x).float().abs().max().item() > 1000.0


# --- situ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("beta", "linear_beta"), [(4.0, 25.0), (1.5, 3.0), (4.0, None)])
def test_situ_matches_reference(dtype: torch.dtype, beta: float, linear_beta: float | None) -> None:
    x = _inputs((7, 2 * 40), seed=3, scale=6.0, dtype=dtype)
    _assert_close(situ_torch(x, beta, linear_beta), _ref_situ(x, beta, linear_beta), dtype)


def test_situ_defaults_are_kimi_k3_constants() -> None:
    x = _inputs((4, 2 * 16), seed=4, scale=30.0, dtype=torch.float32)
    _assert_close(situ_torch(x), _ref_situ(x, 4.0, 25.0), torch.float32)


def test_situ_soft_caps_at_large_magnitudes() -> None:
    x = _inputs((32, 2 * 64), seed=5, scale=1000.0, dtype=torch.float32)
    out = situ_torch(x)
    assert out.abs().max().item() <= 4.0 * 25.0
    assert out.abs().max().item() > 90.0, "large gate and up saturate close to beta * linear_beta"
    _assert_close(out, _ref_situ(x, 4.0, 25.0), torch.float32)


# --- act_and_mul ---------------------------------------------------------------------------------


def test_activations_constant() -> None:
    assert ACTIVATIONS == ("swiglu", "situ")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul_cpu_dispatch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> torch.Tensor:
        raise AssertionError("the Triton kernel must not run for CPU tensors")

    monkeypatch.setitem(sys.modules, KERNEL_MODULE, types.SimpleNamespace(act_and_mul_triton=boom))
    x = _inputs((9, 2 * 32), seed=6, scale=12.0, dtype=dtype)
    _assert_close(act_and_mul(x, "swiglu"), _ref_swiglu(x, None), dtype)
    _assert_close(act_and_mul(x, "swiglu", swiglu_limit=5.0), _ref_swiglu(x, 5.0), dtype)
    _assert_close(act_and_mul(x, "situ"), _ref_situ(x, 4.0, 25.0), dtype)


def test_act_and_mul_gpu_dispatch_calls_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    sentinel = torch.full((2, 3), 0.25)

    def fake_kernel(gate_up: torch.Tensor, activation: str, limit: float | None) -> torch.Tensor:
        calls.append((gate_up, activation, limit))
        return sentinel

    monkeypatch.setitem(
        sys.modules, KERNEL_MODULE, types.SimpleNamespace(act_and_mul_triton=fake_kernel)
    )
    monkeypatch.setattr(act_mod, "_use_triton", lambda t: True)
    x = _inputs((2, 6), seed=7, scale=1.0, dtype=torch.float32)
    assert act_and_mul(x, "swiglu", swiglu_limit=7.0) is sentinel
    assert act_and_mul(x, "situ") is sentinel
    assert [(c[1], c[2]) for c in calls] == [("swiglu", 7.0), ("situ", None)]
    assert all(c[0] is x for c in calls)


def test_unknown_activation_is_named() -> None:
    x = _inputs((2, 8), seed=8, scale=1.0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"unknown activation 'gelu'.*\('swiglu', 'situ'\)"):
        act_and_mul(x, "gelu")  # type: ignore[arg-type]


def test_input_errors() -> None:
    x = _inputs((2, 8), seed=9, scale=1.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="swiglu_limit applies only to 'swiglu'"):
        act_and_mul(x, "situ", swiglu_limit=7.0)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_torch(x[:, :7])
    with pytest.raises(ValueError, match="even last dim"):
        situ_torch(x[:, :7])
    with pytest.raises(ValueError, match="swiglu limit must be > 0"):
        swiglu_torch(x, -1.0)
    with pytest.raises(ValueError, match="linear_beta must be > 0"):
        situ_torch(x, 4.0, 0.0)


if __name__ == "__main__":
    run_this_file(__file__)
