"""Checks of the FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) shared by the CPU tests (the Triton
kernels under the interpreter, small widths) and the GPU tests (the compiled kernels at DeepSeek
V4's and Kimi K3's widths). Fresh random inputs every time.

Tolerances, and why:
- the format: a dequantised value is within half an e4m3 step of its input, ``2^-4`` relative
  (3 fraction bits), or ``2^-10`` of its group's scale below the normal range; bf16 values
  exactly; every dequantised value is a bf16 value.
- readers (sparse decode / prefill attention, indexer scores, absorbed MLA decode) against the
  torch maths on the *same FP8 bits* decoded: the kernels dequantise into the bf16 values the
  torch path sees, so only summation order differs (1e-5 of the largest output, 2e-5 where the
  prefill keeps 16 bits of each probability); against the unquantised cache: what quantising
  the keys moves (``FP8_ATTN_TOL``: each value's rounding is ~3.6% rms).
- writers (the compressor kernels) against their torch path: both quantise the same fp32 entry
  up to summation order, so the bytes are equal except where that difference crosses a rounding
  boundary (rare: ``MAX_BYTE_FLIPS``), and there the values are one e4m3 step apart at most.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.attention.absorbed_mla_decode import absorbed_mla_decode
from sglang.kernels.ops.attention.indexer_scores import indexer_scores
from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention
from sglang.kernels.ops.attention.sparse_prefill_attention import sparse_prefill_attention
from sglang.kernels.ops.quant.fp8_row_write import write_fp8_rows
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat, encode_e4m3, load_rows
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.attention.dsv4_core import dsv4_attention
from sglang.srt.layers.attention.dsv4_static_compressor import (
    compress_decode_step,
    compress_decode_torch,
    use_decode_kernel,
)
from sglang.srt.layers.attention.dsv4_static_decode import sink_attention
from sglang.srt.layers.kv_cache_rows import Fp8Rows
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding
from sglang.srt.mem_cache.compressor_state import CompressorState
from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots
from sglang.test.compressor_decode_cases import random_compressor
from sglang.test.compressor_slot_state import clone_slots

READ_TOL = 1e-5  # kernel vs torch on the same FP8 bits: summation order
PREFILL_READ_TOL = 2e-5  # the prefill's default two-part probabilities (16 bits each)
# FP8 keys vs the unquantised keys, relative Frobenius error of the outputs: e4m3 rounding is ~3.6%
# rms of each value (half a step of 2^-3, uniform); the outputs moved 0.8-3.7% when measured.
FP8_ATTN_TOL = 0.08
MAX_BYTE_FLIPS = 0.02  # writer kernel vs torch: codes that may round the other way


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def frob(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# --- the format --------------------------------------------------------------------------


def check_round_trip(fmt: Fp8RowFormat, device: str, rows: int = 64, seed: int = 0) -> None:
    """Quantise and dequantise fresh random rows (log-normal magnitudes, one all-zero row, one
    outlier): within e4m3 precision, bf16 tail exact, dequantised values bf16 values, group
    scales the least power of two that fits."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, fmt.dim, generator=g, device=device)
    x *= torch.exp(2 * torch.randn(rows, fmt.dim, generator=g, device=device))
    x[1] = 0.0
    x[2, 0] = 3e4  # an outlier: the rest of its group goes subnormal
    q = fmt.quantize(x)
    assert q.dtype == torch.uint8 and q.shape == (rows, fmt.row_bytes)
    dq = fmt.dequantize(q)
    f, grp = fmt.fp8_dims, fmt.group
    k = q[:, fmt.scale_offset : fmt.scale_offset + fmt.num_scales].int() - 127
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
    amax = x[:, :f].abs().reshape(rows, -1, grp).amax(-1)
    # the least power of two with amax <= 448 * scale (zero groups: the smallest allowed)
    live = amax > 0
    assert bool((amax <= 448 * scale).all()) and bool((amax[live] > 224 * scale[live]).all())
    err = (dq[:, :f] - x[:, :f]).abs().reshape(rows, -1, grp)
    bound = torch.maximum(
        2.0**-4 * x[:, :f].abs().reshape(rows, -1, grp), 2.0**-10 * scale[..., None]
    )
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    assert torch.equal(dq[:, f:], x[:, f:].to(torch.bfloat16).float())
    assert torch.equal(dq.to(torch.bfloat16).float(), dq)  # exact in bf16
    assert torch.equal(fmt.dequantize(q, torch.bfloat16).float(), dq)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, encode_e4m3(tl.load(x_ptr + i)).to(tl.uint8))


@triton.jit
def _load_kernel(
    rows_ptr, out_ptr, n, row_bytes,
    DIM: tl.constexpr, DIM_P2: tl.constexpr, N_P2: tl.constexpr, F: tl.constexpr,
    ROPE: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, N_P2)
    live = r < n
    cols = tl.arange(0, DIM_P2)
    v = load_rows(
        rows_ptr, r.to(tl.int64) * row_bytes, live, 0, DIM_P2, F, ROPE, ROPE_OFF, SCALE_OFF, G
    )
    mask = live[:, None] & (cols < DIM)[None, :]
    tl.store(out_ptr + r[:, None] * DIM + cols[None, :], v, mask=mask)


def check_triton_codec(fmts: list[Fp8RowFormat], device: str) -> None:
    """The Triton encoder against torch's cast on every e4m3 value, the midpoints between them
    (ties to even), values just off them, subnormals and random values; the row write kernel's
    bytes against :meth:`Fp8RowFormat.quantize`; the kernels' row load against
    :meth:`Fp8RowFormat.dequantize`."""
    grid = torch.arange(0, 127, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    grid = grid.float()
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator(device).manual_seed(1)
    x = torch.cat(
        [
            grid,
            mids,
            mids * (1 + 2**-20),
            mids * (1 - 2**-20),
            torch.rand(4096, generator=g, device=device) * 448,
            torch.rand(1024, generator=g, device=device) * 2**-6,
            torch.tensor([0.0, 1e-40, 2.0**-10, 448.0], device=device),
        ]
    )
    x = torch.cat([x, -x])
    pad = (-x.numel()) % 1024
    x = torch.cat([x, torch.zeros(pad, device=device)])
    got = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    _encode_kernel[(x.numel() // 1024,)](x, got, BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:8].tolist()

    for i, fmt in enumerate(fmts):
        vals = torch.randn(12, fmt.dim, generator=g, device=device)
        vals *= torch.exp(torch.randn(12, fmt.dim, generator=g, device=device))
        vals[4] = 0.0
        store = torch.zeros(40, fmt.row_bytes, dtype=torch.uint8, device=device)
        dest = torch.randperm(40, generator=g, device=device)[:12]
        write_fp8_rows(vals, store, dest, fmt)
        want_rows = fmt.quantize(vals)
        assert torch.equal(store[dest], want_rows), f"{fmt}: written bytes differ"
        untouched = torch.ones(40, dtype=torch.bool, device=device)
        untouched[dest] = False
        assert not store[untouched].any(), "the write touched other rows"
        out = torch.empty(12, fmt.dim, device=device)
        _load_kernel[(1,)](
            want_rows, out, 12, fmt.row_bytes,
            DIM=fmt.dim, DIM_P2=triton.next_power_of_2(fmt.dim), N_P2=16, F=fmt.fp8_dims,
            ROPE=fmt.rope, ROPE_OFF=fmt.rope_offset, SCALE_OFF=fmt.scale_offset, G=fmt.group,
        )  # fmt: skip
        assert torch.equal(out, fmt.dequantize(want_rows)), f"case {i}: loaded values differ"


# --- writers: the compressor kernels -------------------------------------------------------


def _compressor(
    ratio: int, dim: int, rope: int, device: str, seed: int
) -> tuple[KVCompressor, InterleavedRotaryEmbedding]:
    g = torch.Generator(device).manual_seed(seed)
    return random_compressor(32, dim, ratio, overlap=ratio == 4, device=device, g=g, rope_dim=rope)


def assert_same_fp8_rows(got: torch.Tensor, want: torch.Tensor, fmt: Fp8RowFormat) -> None:
    """Writer kernel vs its torch path on the same fp32 maths: bytes equal but for rare rounding
    flips, the values there within one e4m3 step."""
    flips = float((got != want).float().mean())
    assert flips <= MAX_BYTE_FLIPS, f"{flips:.3%} of the bytes differ"
    a, b = fmt.dequantize(got), fmt.dequantize(want)
    slack = 1e-5 * float(b.abs().max())
    step = 2.0**-3 * torch.maximum(a.abs(), b.abs()) + slack
    assert bool(((a - b).abs() <= step).all()), float(((a - b).abs() / step).max())


def assert_fp8_close_to(dq: torch.Tensor, plain: torch.Tensor) -> None:
    """Dequantised FP8 entries against the same entries unquantised: half an e4m3 step each
    (plus the subnormal range's absolute step, below ``1e-5`` of the largest)."""
    bound = 2.0**-4 * plain.abs() + 1e-5 * float(plain.abs().max())
    assert bool(((dq - plain).abs() <= bound).all()), float(((dq - plain).abs() / bound).max())


def check_compress_prefill(
    ratio: int, dim: int, rope: int, tail: int, device: str, chunks: tuple[int, ...] = (7, 13, 1, 9)
) -> None:
    """``KVCompressor.append`` through the prefill kernel writing FP8 rows (``tail`` values
    bf16), against its torch path (the same FP8 encoding) and the fp32 entries of a plain
    state."""
    comp, rotary = _compressor(ratio, dim, rope, device, seed=ratio + dim)
    fmt = Fp8RowFormat(dim, tail)
    codec = Fp8Rows(fmt, torch.float32)

    def state(encoding: Fp8Rows | None) -> CompressorState:
        return CompressorState(
            ratio=ratio, dim=dim, overlap=comp.overlap, entry_dtype=torch.float32,
            device=device, encoding=encoding,
        )  # fmt: skip

    fused, ref, plain = state(codec), state(codec), state(None)
    g = torch.Generator(device).manual_seed(3)
    width = comp.ape.shape[1]
    kernel_path = KVCompressor._use_prefill_kernel
    torch_path = lambda *a: False
    try:
        with torch.no_grad():
            for t in chunks:
                kv = torch.randn(t, width, generator=g, device=device) * 2
                score = torch.randn(t, width, generator=g, device=device) * 2
                assert kernel_path(comp, fused, kv, score, rotary), "the kernel must run"
                got = comp.append(fused, kv, score, rotary)
                KVCompressor._use_prefill_kernel = torch_path  # type: ignore[method-assign]
                want = comp.append(ref, kv, score, rotary)
                comp.append(plain, kv, score, rotary)
                KVCompressor._use_prefill_kernel = kernel_path  # type: ignore[method-assign]
                assert got.dtype == torch.uint8 and got.shape == want.shape
    finally:
        KVCompressor._use_prefill_kernel = kernel_path  # type: ignore[method-assign]
    assert fused.num_entries == ref.num_entries == plain.num_entries > 0
    assert_same_fp8_rows(fused.entries.rows(), ref.entries.rows(), fmt)
    assert_fp8_close_to(fused.entry_values(torch.float32), plain.entries.rows())


def check_compress_decode(
    ratio: int, dim: int, rope: int, tail: int, device: str, steps: int = 6
) -> None:
    """``compress_decode_step`` through the fused kernel writing FP8 rows (``tail`` values bf16)
    into the paged store,
    against ``compress_decode_torch`` (same encoding) and a plain fp32 store, over several
    steps of shuffled slots with two padding rows on the scratch slot."""
    comp, rotary = _compressor(ratio, dim, rope, device, seed=2 * ratio + dim)
    fmt = Fp8RowFormat(dim, tail)
    real, max_blocks, block_tokens = 5, 3, 4 * ratio
    nb = real * max_blocks
    g = torch.Generator(device).manual_seed(5)
    dev = torch.device(device)

    def store(encoding: Fp8Rows | None) -> CompressorSlots:
        return CompressorSlots.allocate(
            real + 1, nb, block_tokens, ratio, dim, overlap=comp.overlap, dtype=torch.float32,
            device=dev, encoding=encoding,
        )  # fmt: skip

    got, want, plain = store(Fp8Rows(fmt, torch.float32)), None, store(None)
    for t in (got.pending_kv, got.pending_score, got.prev_kv, got.prev_score):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=g, device=device))
    for slot in range(real + 1):
        got.reset(slot)
    want = clone_slots(got)
    for name in ("pending_kv", "pending_score", "prev_kv", "prev_score"):
        t = getattr(plain, name)
        if t is not None:
            t.copy_(getattr(got, name))
    table = torch.full((real + 1, max_blocks), nb, dtype=torch.long, device=device)
    table[:real] = torch.randperm(nb, generator=g, device=device).view(real, max_blocks)
    probe = torch.empty(1, 1, device=device)
    assert use_decode_kernel(got, probe, probe, table, rotary)
    slots = torch.cat([torch.randperm(real, generator=g, device=device),
                       torch.full((2,), real, device=device)])  # fmt: skip
    start = torch.tensor([ratio - steps // 2, 0, 2 * ratio - 1, 5 * ratio - 3, 3], device=device)
    start = start.clamp(min=0)[:real]
    width = comp.ape.shape[1]
    with torch.no_grad():
        for step in range(steps):
            pos = torch.cat([start + step, torch.tensor([0, ratio - 1], device=device)])
            kv = torch.randn(real + 2, width, generator=g, device=device)
            score = torch.randn(real + 2, width, generator=g, device=device) * 3
            compress_decode_step(comp, got, kv, score, pos, slots, table, rotary)
            compress_decode_torch(comp, want, kv, score, pos, slots, table, rotary)
            compress_decode_torch(comp, plain, kv, score, pos, slots, table, rotary)
    blocks = table[:real].flatten()
    assert got.entries[blocks].any(), "no entry was written"
    assert_same_fp8_rows(got.entries[blocks], want.entries[blocks], fmt)
    # only the rows a block completed were written: compare those against the plain store
    written = (want.entries[blocks] != 0).any(-1)
    dq = fmt.dequantize(got.entries[blocks][written])
    assert_fp8_close_to(dq, plain.entries[blocks][written])


# --- readers -----------------------------------------------------------------------------


def _fp8_store(values: torch.Tensor, fmt: Fp8RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [..., dim]`` as FP8 rows and their decoded values (what every reader sees)."""
    rows = fmt.quantize(values)
    return rows, fmt.dequantize(rows)


def check_sparse_decode(
    heads: int, dim: int, rope: int, window: int, device: str, ring_dtype: torch.dtype
) -> None:
    """The decode attention over a window ring and paged FP8 entries (ratio 128: every visible
    entry; ratio 4: the indexer's picks) against ``sink_attention`` on the decoded entries, and
    the FP8 run against the same keys unquantised."""
    g = torch.Generator(device).manual_seed(heads + dim)
    fmt = Fp8RowFormat(dim, rope)
    slots_total, rpb, max_blocks = 5, 8, 4
    nb = (slots_total - 1) * max_blocks
    ring = torch.randn(slots_total, window, dim, generator=g, device=device).to(ring_dtype)
    plain = torch.randn(nb + 1, rpb, dim, generator=g, device=device)
    plain = plain.to(torch.bfloat16).float()  # the values a bf16 cache would hold
    rows, decoded = _fp8_store(plain, fmt)
    table = torch.full((slots_total, max_blocks), nb, dtype=torch.long, device=device)
    table[: slots_total - 1] = torch.randperm(nb, generator=g, device=device).view(-1, max_blocks)
    slots = torch.tensor([2, 0, 3, slots_total - 1], device=device)
    q = torch.randn(4, heads, dim, generator=g, device=device).to(ring_dtype)
    sink = torch.randn(heads, generator=g, device=device)
    scale = dim**-0.5
    # positions: few entries visible, every one (the table's whole capacity), a wrapped ring
    # with some, and the scratch slot's padding row at 0
    for ratio, k in ((128, 0), (4, 6)):
        full = max_blocks * rpb * ratio
        positions = torch.tensor([5 * ratio + 3, full - 1, 9 * ratio + window, 0], device=device)
        visible = torch.div(positions + 1, ratio, rounding_mode="floor")
        picks = None
        if k:
            scores = torch.randn(4, max_blocks * rpb, generator=g, device=device)
            cols = torch.arange(max_blocks * rpb, device=device)
            scores = scores.masked_fill(cols[None, :] >= visible[:, None], float("-inf"))
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        got = sparse_decode_attention(
            q, ring, slots, positions, sink, scale, entries=rows, ratio=ratio, picks=picks,
            table=table, entry_fp8=fmt,
        )  # fmt: skip
        for keys_src, tol in ((decoded, READ_TOL), (plain, None)):
            want = _decode_reference(q, ring, keys_src, table, slots, positions, sink, scale,
                                     ratio, picks)  # fmt: skip
            if tol is not None:
                assert rel(got, want) <= tol, (ratio, rel(got, want))
            else:
                assert frob(got, want) <= FP8_ATTN_TOL, (ratio, frob(got, want))


def _decode_reference(
    q: torch.Tensor,
    ring: torch.Tensor,
    entries: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    ratio: int,
    picks: torch.Tensor | None,
) -> torch.Tensor:
    """The static decode's torch maths: every ring row (valid by position) and the visible
    entries (or the picks), one softmax with the sink."""
    window = ring.shape[1]
    rows = torch.arange(window, device=q.device)
    win_pos = positions[:, None] - (positions[:, None] - rows[None, :]) % window
    per_slot = entries[table[slots]].reshape(slots.shape[0], -1, entries.shape[-1])
    visible = torch.div(positions + 1, ratio, rounding_mode="floor")
    ids = torch.arange(per_slot.shape[1], device=q.device)
    if picks is None:
        ent, ok = per_slot, ids[None, :] < visible[:, None]
    else:
        ent = per_slot.gather(1, picks[..., None].expand(-1, -1, per_slot.shape[-1]))
        ok = torch.arange(picks.shape[1], device=q.device)[None, :] < visible[:, None]
    keys = torch.cat([ring[slots].float(), ent.float()], dim=1)
    valid = torch.cat([win_pos >= 0, ok], dim=1)
    return sink_attention(q.float(), keys, valid, sink, scale)


def check_sparse_prefill(heads: int, dim: int, rope: int, device: str) -> None:
    """The prefill attention over FP8 entries (every visible block, then the indexer's picks)
    against ``dsv4_attention`` on the decoded entries, and against the unquantised entries."""
    g = torch.Generator(device).manual_seed(7 + dim)
    fmt = Fp8RowFormat(dim, rope)
    n, window, q_first, num = 40, 16, 90, 32
    win_first = q_first - (window - 1)
    win_kv = torch.randn(window - 1 + n, dim, generator=g, device=device).to(torch.bfloat16)
    plain = torch.randn(num, dim, generator=g, device=device).to(torch.bfloat16).float()
    rows, decoded = _fp8_store(plain, fmt)
    q = (torch.randn(n, heads, dim, generator=g, device=device) * 2).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g, device=device)
    pos = torch.arange(q_first, q_first + n, device=device)
    scale = dim**-0.5
    for ratio, k in ((4, 0), (4, 5)):
        visible = torch.div(pos + 1, ratio, rounding_mode="floor")
        ids = torch.arange(num, device=device)
        mask = ids[None, :] < visible[:, None]
        picks = None
        if k:
            scores = torch.randn(n, num, generator=g, device=device).masked_fill(~mask, -1e30)
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            mask = torch.zeros_like(mask).scatter_(1, picks, True) & mask
        got = sparse_prefill_attention(
            q, q_first, win_kv, win_first, sink, scale=scale, window=window, entries=rows,
            ratio=ratio, picks=picks, entry_fp8=fmt,
        )  # fmt: skip
        for keys_src, tol in ((decoded, PREFILL_READ_TOL), (plain, None)):
            want = dsv4_attention(q, pos, q_first, win_kv, win_first, keys_src, mask, sink,
                                  scale=scale, window=window)  # fmt: skip
            if tol is not None:
                assert rel(got, want) <= tol, (k, rel(got, want))
            else:
                assert frob(got, want) <= FP8_ATTN_TOL, (k, frob(got, want))


def check_indexer_scores(heads: int, dim: int, device: str) -> None:
    """The decode indexer scores over paged FP8 keys against the torch scoring of the decoded
    keys (and the unquantised keys: the scores move by what quantising the keys moves)."""
    g = torch.Generator(device).manual_seed(11 + dim)
    fmt = Fp8RowFormat(dim, 0)
    slots_total, rpb, max_blocks = 4, 16, 3
    nb = (slots_total - 1) * max_blocks
    plain = torch.randn(nb + 1, rpb, dim, generator=g, device=device).to(torch.bfloat16).float()
    rows, decoded = _fp8_store(plain, fmt)
    table = torch.full((slots_total, max_blocks), nb, dtype=torch.long, device=device)
    table[:-1] = torch.randperm(nb, generator=g, device=device).view(-1, max_blocks)
    slots = torch.tensor([1, 0, 2], device=device)
    visible = torch.tensor([5, max_blocks * rpb, 17], device=device)
    q = torch.randn(3, heads, dim, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(3, heads, generator=g, device=device)
    scale = dim**-0.5
    got = indexer_scores(q, w, rows, slots, visible, scale, table=table, key_fp8=fmt)
    cols = torch.arange(max_blocks * rpb, device=device)
    live = cols[None, :] < visible[:, None]
    for keys_src, exact in ((decoded, True), (plain, False)):
        keys = keys_src[table[slots]].reshape(3, -1, dim)
        dots = torch.einsum("bhd,bnd->bhn", q.float(), keys).relu() * scale
        want = (dots * w[..., None]).sum(1)
        assert torch.equal(torch.isinf(got), ~live)
        a, b = got[live], want[live]
        if exact:
            assert rel(a, b) <= READ_TOL, rel(a, b)
        else:
            assert frob(a, b) <= FP8_ATTN_TOL, frob(a, b)


def check_absorbed_mla(heads: int, latent: int, rope: int, device: str) -> None:
    """The absorbed MLA decode over paged FP8 latents against the torch absorbed maths on the
    decoded latents, and against the unquantised latents."""
    g = torch.Generator(device).manual_seed(13 + latent)
    fmt = Fp8RowFormat(latent + rope, rope)
    nb, rpb = 7, 8
    plain = torch.randn(nb + 1, rpb, latent + rope, generator=g, device=device)
    plain = plain.to(torch.bfloat16).float()
    rows, decoded = _fp8_store(plain, fmt)
    table = torch.tensor([[3, 0, 6], [1, nb, nb], [5, 2, 4]], device=device)
    lengths = torch.tensor([19, 4, 24], device=device)
    q_lat = torch.randn(3, heads, latent, generator=g, device=device)
    q_pe = torch.randn(3, heads, rope, generator=g, device=device).to(torch.bfloat16)
    scale = (latent // 4) ** -0.5
    got = absorbed_mla_decode(q_lat, q_pe, rows, table, lengths, scale, fp8=fmt)
    for src, tol in ((decoded, READ_TOL), (plain, None)):
        kv = src[table].reshape(3, -1, latent + rope)
        ckv, kpe = kv.split([latent, rope], dim=-1)
        s = (q_lat @ ckv.transpose(1, 2) + q_pe.float() @ kpe.transpose(1, 2)) * scale
        live = torch.arange(kv.shape[1], device=device)[None, :] < lengths[:, None]
        s = s.masked_fill(~live[:, None, :], float("-inf"))
        want = torch.softmax(s, dim=-1) @ ckv
        if tol is not None:
            assert rel(got, want) <= tol, rel(got, want)
        else:
            assert frob(got, want) <= FP8_ATTN_TOL, frob(got, want)
