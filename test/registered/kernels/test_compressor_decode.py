"""The fused DeepSeek V4 compressor decode step (``compress_decode``) against the torch path it
replaces (``compress_decode_torch``), on fresh random state and inputs.

Cases: overlap (ratio 4, ``coff`` 2: the kept previous block's rows, ``-inf`` "none" rows on
block-0 slots) at the indexer (128) and attention (512) widths, and no overlap (ratio 128, 128
pending rows; at width 512 the candidates loop over chunks); fp32 and bf16 entries; rows that
complete a block (block 0 included) and rows that do not, a shuffled slot order, a shuffled block
table, and two padding rows sharing the scratch slot. Several steps in a row, so the state each
path leaves feeds the next step. Checked: the pending and previous-block rows bit-equal (copies
and one fp32 add on both sides), entries to 1e-6 of the largest (fp32; only summation order and
``exp`` differ) or within one bf16 ulp plus that 1e-6 (``assert_bf16_close``; the interpreter
truncates its fp32->bf16 casts), and
blocks no row completes untouched. The scratch slot and the null block are excluded: padding
rows race there, in both paths.

On CPU the kernel runs under the Triton interpreter, which must be on before Triton is imported:
``test_kernel_under_interpreter`` reruns this file's ``interp_`` tests in a subprocess. The
``gpu`` tests run the compiled kernel (skipped without CUDA) at the bench widths, the same step
captured in a CUDA graph and replayed, and ``KVCompressor.project``'s one GEMM over both weights
(they share one buffer; loading fills them in place) against the two GEMMs it replaces.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.kernels.ops.attention import compressor_decode
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor, _fp32_matmul
from sglang.srt.layers.attention.dsv4_static_compressor import (
    compress_decode_step,
    compress_decode_torch,
    use_decode_kernel,
)
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots
from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.compressor_decode_cases import HIDDEN, Case, make_case
from sglang.test.compressor_slot_state import clone_slots
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.run import run_this_file
from sglang.test.tolerance import assert_bf16_close

register_cpu_ci(est_time=25)
register_cuda_ci(est_time=30, suite="h200-1gpu")  # its @pytest.mark.gpu tests

FP32_TOL = 1e-6


def start_positions(case: Case, steps: int, g: torch.Generator, device: str) -> torch.Tensor:
    """One start a real slot, each moving on by one a step: slot 0 completes block 0 at the
    last step (or on the way), slot 1 a later block, slot 2 starts at 0, slot 3 completes a
    block at once, the rest anywhere the table's 3 blocks hold."""
    ratio = case.compressor.ratio
    base = torch.randint(0, 12 * ratio - steps, (case.real_slots,), generator=g, device=device)
    base[0] = max(ratio - steps, 0)
    base[1] = 5 * ratio - steps
    base[2] = 0
    base[3] = 3 * ratio - 1
    return base


def check_equal_states(case: Case, got: CompressorSlots, want: CompressorSlots) -> float:
    """Asserts the paths agree outside the scratch slot and the null block; returns the fp32
    entries' error relative to the largest entry (0 for bf16)."""
    s = case.real_slots
    for name in ("pending_kv", "pending_score", "prev_kv", "prev_score"):
        a, b = getattr(got, name), getattr(want, name)
        if b is not None:
            assert torch.equal(a[:s], b[:s]), name
    a, b = got.entries[: case.null_block].float(), want.entries[: case.null_block].float()
    if want.entries.dtype == torch.float32:
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= FP32_TOL, err
        return err
    assert_bf16_close(a, b, FP32_TOL)
    return 0.0


def run_case(
    ratio: int,
    overlap: bool,
    dim: int,
    entry_dtype: torch.dtype,
    device: str,
    steps: int,
    tile: int | None = None,
) -> float:
    """``tile``: a smaller tile budget, so the candidates loop over chunks / split channels."""
    old_tile = compressor_decode.TILE_ELEMS
    if tile is not None:
        compressor_decode.TILE_ELEMS = tile
    try:
        return _run_case(ratio, overlap, dim, entry_dtype, device, steps)
    finally:
        compressor_decode.TILE_ELEMS = old_tile


def _run_case(
    ratio: int, overlap: bool, dim: int, entry_dtype: torch.dtype, device: str, steps: int
) -> float:
    case = make_case(ratio, overlap, dim, entry_dtype, device, seed=ratio + dim + steps)
    g = torch.Generator(device).manual_seed(7 + dim)
    # Block-0 rows have "no previous block" (their slots were reset when taken); the scratch too.
    for slot in (0, 2, case.real_slots):
        case.store.reset(slot)
    got, want = case.store, clone_slots(case.store)
    probe = torch.empty(1, 1, device=device)
    assert use_decode_kernel(got, probe, probe, case.table, case.rotary)
    # Slots shuffled, then two padding rows on the scratch slot.
    order = torch.randperm(case.real_slots, generator=g, device=device)
    scratch = torch.full((2,), case.real_slots, dtype=torch.long, device=device)
    slots = torch.cat([order, scratch])
    width = case.compressor.ape.shape[1]
    start = start_positions(case, steps, g, device)[order]
    comp, table, rotary = case.compressor, case.table, case.rotary
    worst = 0.0
    with torch.no_grad():
        for step in range(steps):
            positions = torch.cat([start + step, torch.tensor([0, ratio - 1], device=device)])
            both = torch.randn(slots.shape[0], 2 * width, generator=g, device=device)
            both[:, width:] *= 3
            kv, score = both[:, :width], both[:, width:]  # strided rows, as one projection gives
            if step % 2:
                kv, score = kv.contiguous(), score.contiguous()
            before = got.entries.clone()
            compress_decode_step(comp, got, kv, score, positions, slots, table, rotary)
            compress_decode_torch(comp, want, kv, score, positions, slots, table, rotary)
            worst = max(worst, check_equal_states(case, got, want))
            # Only the completed rows' entries moved.
            touched = torch.zeros(got.entries.shape[:2], dtype=torch.bool, device=device)
            done = ((positions + 1) % ratio == 0) & (slots < case.real_slots)
            blk = torch.div(positions, ratio, rounding_mode="floor")
            rpb = got.entries.shape[1]
            touched[case.table[slots, blk // rpb][done], (blk % rpb)[done]] = True
            moved = (got.entries != before).any(-1)
            moved[case.null_block] = False
            assert not (moved & ~touched).any(), "a row that completed nothing wrote an entry"
    return worst


# (ratio, overlap, D, entry dtype, steps, tile budget): one program a row (ratio 4; ratio 128
# at D 64), programs per channel block (ratio 128 at D 512), and with a small tile budget the
# split path with overlap and the candidates in several chunks.
CPU_CASES = [
    (4, True, 128, torch.bfloat16, 3, None),
    (4, True, 512, torch.float32, 2, None),
    (128, False, 64, torch.float32, 2, None),
    (128, False, 512, torch.bfloat16, 1, None),
    (4, True, 64, torch.float32, 2, 64),
    (128, False, 64, torch.bfloat16, 1, 256),
]


@interp_only
@pytest.mark.parametrize("ratio,overlap,dim,dtype,steps,tile", CPU_CASES)
def test_interp_kernel_matches_torch(
    ratio: int, overlap: bool, dim: int, dtype: torch.dtype, steps: int, tile: int | None
) -> None:
    worst = run_case(ratio, overlap, dim, dtype, "cpu", steps, tile)
    print(f"ratio {ratio} dim {dim} {dtype}: fp32 entry error {worst:.2e}")


@interp_only
def test_interp_bad_shapes_take_the_torch_path() -> None:
    case = make_case(4, True, 48, torch.float32, "cpu", seed=1)  # 48: not a power of two
    probe = torch.empty(1, 1)
    assert not use_decode_kernel(case.store, probe, probe, case.table, case.rotary)


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_kernel_under_interpreter() -> None:
    run_interp_tests(str(Path(__file__).resolve()))


def test_cpu_tensors_take_the_torch_path() -> None:
    if IN_INTERPRETER:
        pytest.skip("the interpreter runs the kernel on CPU tensors")
    case = make_case(4, True, 128, torch.float32, "cpu", seed=2)
    probe = torch.empty(1, 1)
    assert not use_decode_kernel(case.store, probe, probe, case.table, case.rotary)


def _loaded_compressor(device: str, dtype: torch.dtype, hidden: int = HIDDEN) -> KVCompressor:
    """A ratio-4 compressor whose projections came in through their loaders (as the checkpoint
    loop hands them over)."""
    g = torch.Generator(device).manual_seed(11)
    comp = KVCompressor(hidden, 128, 4, LayerBuildSpec(dtype=dtype, device=device),
                        overlap=True, rms_eps=1e-6)  # fmt: skip
    for lin in (comp.wkv, comp.wgate):
        full = torch.randn(lin.weight.shape, generator=g, device=device) * hidden**-0.5
        lin.weight.weight_loader(lin.weight, full)
    return comp


def test_projection_weights_share_one_buffer_until_moved() -> None:
    comp = _loaded_compressor("cpu", torch.bfloat16)
    both = comp._both_weights()
    assert both is not None
    assert torch.equal(both, torch.cat([comp.wkv.weight, comp.wgate.weight]))
    assert dict(comp.named_parameters()).keys() >= {"wkv.weight", "wgate.weight"}
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    kv, score = comp.project(x)  # CPU: two upcast products, as before
    assert torch.equal(kv, x.float() @ comp.wkv.weight.float().t())
    assert torch.equal(score, x.float() @ comp.wgate.weight.float().t())
    comp.to(torch.float32)  # new storage per weight: the one-GEMM view is gone
    assert comp._both_weights() is None


GPU_CASES = [
    (4, True, 128, torch.bfloat16, 6, None),
    (4, True, 512, torch.bfloat16, 6, None),
    (4, True, 512, torch.float32, 6, None),
    (128, False, 512, torch.float32, 3, None),
    (128, False, 512, torch.bfloat16, 3, None),
    (4, True, 512, torch.float32, 6, 64),
    (128, False, 512, torch.float32, 3, 1024),
]


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,overlap,dim,dtype,steps,tile", GPU_CASES)
def test_gpu_kernel_matches_torch(
    ratio: int, overlap: bool, dim: int, dtype: torch.dtype, steps: int, tile: int | None
) -> None:
    worst = run_case(ratio, overlap, dim, dtype, "cuda", steps, tile)
    print(f"ratio {ratio} dim {dim} {dtype}: fp32 entry error {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_gpu_one_gemm_projection_matches_two(tokens: int) -> None:
    """One GEMM over both weights == the two GEMMs it replaces and the fp32 product of the upcast
    operands (fp32-accumulated dot products over K=4096: only summation order differs; cuBLAS
    picks another split of K per output width at some sizes, measured 2.9e-6 at 300 rows)."""
    comp = _loaded_compressor("cuda", torch.bfloat16, hidden=4096)
    assert comp._both_weights() is not None
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    kv, score = comp.project(x)
    assert kv.stride(0) == 2 * kv.shape[1]  # halves of one output: the one-GEMM path ran
    for got, lin in ((kv, comp.wkv), (score, comp.wgate)):
        two = _fp32_matmul(x, lin.weight)
        assert float((got - two).abs().max() / two.abs().max()) <= 1e-5
        ref = x.float() @ lin.weight.float().t()
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager() -> None:
    """The step captured once and replayed at other positions == eager kernel calls."""
    case = make_case(4, True, 512, torch.bfloat16, "cuda", seed=3)
    g = torch.Generator("cuda").manual_seed(4)
    bs, width = case.real_slots, case.compressor.ape.shape[1]
    slots = torch.arange(bs, device="cuda")
    kv = torch.randn(bs, width, generator=g, device="cuda")
    score = torch.randn(bs, width, generator=g, device="cuda")
    positions = torch.zeros(bs, dtype=torch.long, device="cuda")
    eager = clone_slots(case.store)

    def step(store: CompressorSlots) -> None:
        compress_decode_step(case.compressor, store, kv, score, positions, slots, case.table,
                             case.rotary)  # fmt: skip

    with torch.no_grad():
        step(clone_slots(case.store))  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(case.store)
        for t in range(2 * case.compressor.ratio + 1):
            positions.copy_(torch.arange(bs, device="cuda") * 3 + t)
            kv.copy_(torch.randn(bs, width, generator=g, device="cuda"))
            score.copy_(torch.randn(bs, width, generator=g, device="cuda"))
            graph.replay()
            step(eager)
    for name in ("entries", "pending_kv", "pending_score", "prev_kv", "prev_score"):
        assert torch.equal(getattr(case.store, name), getattr(eager, name)), name


if __name__ == "__main__":
    run_this_file(__file__)
