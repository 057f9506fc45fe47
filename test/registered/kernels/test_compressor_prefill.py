"""The fused DeepSeek V4 compressor prefill (``compress_prefill``, taken by ``KVCompressor.append``
where Triton runs) against the torch chain it replaces, on fresh random state and inputs.

Two states start equal (random pending rows, a random kept previous block, some entries already
made) and take the same chunks, one through the kernel and one through the torch path; chunk
sizes cover no block completed, exactly one, one begun in the pending rows, many, and an empty
chunk. Projections are column halves of one tensor (as ``KVCompressor.project`` returns them).
Checked after every chunk: pending and previous-block rows bit-equal (copies and one fp32 add on
both sides), entries to 1e-6 of the largest (fp32; only summation order and ``exp`` differ) or
within one bf16 ulp of the larger of the pair plus that 1e-6 (``assert_bf16_close``: fp32 values
that far apart stay as far apart in bf16, which decides tiny entries), and the counters. Cases:
overlap (ratio 4) at the indexer (128) and attention (512) widths, no overlap (ratio 8, width
128), fp32 and bf16 entries.

On CPU the kernel runs under the Triton interpreter (``test_kernel_under_interpreter`` reruns
the ``interp_`` tests in a subprocess); the ``gpu`` test runs the compiled kernel at the bench
width with an 8192-token chunk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.kernels.ops.attention.compressor_prefill import compress_prefill_reason
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding
from sglang.srt.mem_cache.compressor_state import CompressorState
from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.compressor_decode_cases import random_compressor
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.run import run_this_file
from sglang.test.tolerance import assert_bf16_close, bf16_mismatches

register_cpu_ci(est_time=20)
register_cuda_ci(est_time=15, suite="h200-1gpu")  # its @pytest.mark.gpu tests

FP32_TOL = 1e-6
CHUNKS = (3, 0, 1, 4, 2, 9, 1, 17, 6)


def make_compressor(
    ratio: int, overlap: bool, dim: int, device: str, seed: int
) -> tuple[KVCompressor, InterleavedRotaryEmbedding]:
    g = torch.Generator(device).manual_seed(seed)
    return random_compressor(16, dim, ratio, overlap=overlap, device=device, g=g)


def make_states(
    comp: KVCompressor, entry_dtype: torch.dtype, device: str, seed: int
) -> tuple[CompressorState, CompressorState]:
    """Two equal states mid-request: 5 entries made, 3 rows pending, a kept previous block."""
    g = torch.Generator(device).manual_seed(seed)
    states = []
    for _ in range(2):
        st = CompressorState(
            ratio=comp.ratio, dim=comp.dim, overlap=comp.overlap, entry_dtype=entry_dtype,
            device=device,
        )  # fmt: skip
        states.append(st)
    width = comp.ape.shape[1]
    pend_kv = torch.randn(comp.ratio, width, generator=g, device=device) * 2
    pend_score = torch.randn(comp.ratio, width, generator=g, device=device) * 2
    made = torch.randn(5, comp.dim, generator=g, device=device).to(entry_dtype)
    prev = [torch.randn(comp.ratio, comp.dim, generator=g, device=device) for _ in range(2)]
    for st in states:
        kv_buf, score_buf = st.pending_buffers
        kv_buf.copy_(pend_kv)
        score_buf.copy_(pend_score)
        st.num_pending = min(3, comp.ratio - 1)
        st.entries.append(made)
        if comp.overlap:
            assert st.prev_kv is not None and st.prev_score is not None
            st.prev_kv.copy_(prev[0])
            st.prev_score.copy_(prev[1])
    return states[0], states[1]


def check_states(got: CompressorState, want: CompressorState, entry_dtype: torch.dtype) -> None:
    assert (got.num_pending, got.num_entries) == (want.num_pending, want.num_entries)
    for a, b in zip(got.pending_buffers, want.pending_buffers, strict=True):
        assert torch.equal(a[: got.num_pending], b[: want.num_pending]), "pending rows differ"
    if got.prev_kv is not None:
        assert torch.equal(got.prev_kv, want.prev_kv), "previous-block kv differs"
        assert torch.equal(got.prev_score, want.prev_score), "previous-block scores differ"
    e_got, e_want = got.entries.rows().float(), want.entries.rows().float()
    if entry_dtype == torch.float32:
        scale = e_want.abs().max().clamp_min(1e-30)
        assert ((e_got - e_want).abs().max() / scale).item() <= FP32_TOL
    else:
        assert_bf16_close(e_got, e_want, FP32_TOL)


def run_chunks(
    ratio: int,
    overlap: bool,
    dim: int,
    entry_dtype: torch.dtype,
    device: str,
    chunks: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comp, rotary = make_compressor(ratio, overlap, dim, device, seed=ratio * dim)
    fused, ref = make_states(comp, entry_dtype, device, seed=dim + ratio)
    g = torch.Generator(device).manual_seed(3)
    width = comp.ape.shape[1]
    kernel_path = KVCompressor._use_prefill_kernel
    for t in chunks:
        both = torch.randn(t, 2 * width, generator=g, device=device) * 2  # one GEMM's halves
        kv, score = both[:, :width], both[:, width:]
        with monkeypatch.context() as m:
            m.setattr(KVCompressor, "_use_prefill_kernel", lambda *a: False)
            want = comp.append(ref, kv, score, rotary)
        assert kernel_path(comp, fused, kv, score, rotary), "the kernel must take this case"
        got = comp.append(fused, kv, score, rotary)
        assert got.shape == want.shape and got.dtype == want.dtype
        check_states(fused, ref, entry_dtype)


CASES = [
    (4, True, 128, torch.float32),
    (4, True, 512, torch.bfloat16),
    (8, False, 128, torch.float32),
    (4, True, 128, torch.bfloat16),
]


@interp_only
@pytest.mark.parametrize("ratio,overlap,dim,entry_dtype", CASES)
def test_interp_kernel_matches_torch(
    ratio: int,
    overlap: bool,
    dim: int,
    entry_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_chunks(ratio, overlap, dim, entry_dtype, "cpu", CHUNKS, monkeypatch)


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_kernel_under_interpreter() -> None:
    run_interp_tests(str(Path(__file__).resolve()))


def test_unfit_cases_are_refused_with_the_reason() -> None:
    kv = torch.zeros(4, 1024)
    assert compress_prefill_reason(kv, kv, 4, 512, True, 8, torch.bfloat16) is None
    assert "one tile" in str(compress_prefill_reason(kv, kv, 128, 512, False, 8, torch.bfloat16))
    assert "power-of-two" in str(compress_prefill_reason(kv, kv, 4, 96, True, 8, torch.float32))
    assert "fp32 projections" in str(
        compress_prefill_reason(kv.half(), kv.half(), 4, 512, True, 8, torch.float32)
    )
    assert "entries" in str(compress_prefill_reason(kv, kv, 4, 512, True, 8, torch.int8))
    strided = torch.zeros(4, 2048)[:, ::2]
    why = compress_prefill_reason(kv, kv, 4, 512, True, 8, torch.float32, (strided, None))
    assert "contiguous fp32 pending" in str(why)


def test_cpu_tensors_take_the_torch_path() -> None:
    if IN_INTERPRETER:
        pytest.skip("the interpreter runs the kernel on CPU tensors")
    comp, rotary = make_compressor(4, True, 128, "cpu", seed=1)
    state, _ = make_states(comp, torch.float32, "cpu", seed=2)
    kv = torch.zeros(5, 256)
    assert not comp._use_prefill_kernel(state, kv, kv, rotary)


def test_bf16_check_flags_two_ulps_and_passes_rounding_flips() -> None:
    want = torch.tensor([1.0, 0.5, 3.0, 1e-4, 2e-4]).bfloat16()
    got = want.float().clone()
    got[0] = 1.0 + 2 * 2.0**-7  # two ulps: flagged
    got[1] = 0.5 - 2.0**-9  # one ulp, across a power of two: allowed
    got[3] = 1e-4 + 2e-6  # tiny entry, within 1e-6 of the largest (3.0): allowed
    got[4] = got[4] + 1e-5  # tiny entry beyond the fp32 slack (3e-6) plus its ulp: flagged
    bad = bf16_mismatches(got.bfloat16(), want, FP32_TOL)
    assert bad.tolist() == [True, False, False, False, True]
    with pytest.raises(AssertionError, match="2 of 5"):
        assert_bf16_close(got, want, FP32_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim,entry_dtype", [(512, torch.bfloat16), (128, torch.float32)])
def test_gpu_kernel_matches_torch(
    dim: int, entry_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_chunks(4, True, dim, entry_dtype, "cuda", (8192, 3, 1, 4, 517, 0, 2), monkeypatch)


if __name__ == "__main__":
    run_this_file(__file__)
