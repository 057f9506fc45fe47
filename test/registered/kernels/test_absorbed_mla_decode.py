"""Kimi K3's absorbed MLA decode kernel (``kernels/ops/attention/absorbed_mla_decode.py``) on CPU
under the Triton interpreter (in a subprocess: the interpreter's import state is per process),
plus its host-side contracts.

Against the torch batched pass it replaces (``absorbed_decode`` over ``gather_paged``, fp32), on
fresh random bf16 latents in a shuffled block store of 4-row blocks: lengths 1, across and on
block edges and over several key slices; rows past each length (in its own blocks) and the null
block hold NaN, so a read of them shows; 20 heads (the second head group padded). Both MMA
orientations, two slice plans, exact parts (3/3): only the fp32 summation order differs (bound
1e-5, measured ~4e-7), while one bf16 rounding of the query and the probabilities (1/1) is off
by > 1e-4, so the parts are what makes it exact. A zero-length (padding) row gives zeros; the
lengths are read from device memory, so new lengths in the same tensors give the new answer.
The NoPE MLA layer (bf16, paged, 3 heads) takes the kernel for its batched decode rows and
matches the torch pass to bf16 rounding of its output.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang.kernels.ops.attention.absorbed_mla_decode import (
    AbsorbedDecodeConfig,
    absorbed_decode_unsupported,
    absorbed_mla_decode,
    split_plan,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.paged_mla_cases import SMALL_BLOCK_ROWS, SMALL_DIMS, make_paged
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_max_err

register_cpu_ci(est_time=20)

TOL = 1e-5
LAT, ROPE, NOPE, V = SMALL_DIMS
R = SMALL_BLOCK_ROWS


def _interp_checks() -> None:
    """Run in the interpreter subprocess."""
    from sglang.srt.layers.attention import mla_absorbed_batch as batch

    g = torch.Generator().manual_seed(0)
    scale = (NOPE + ROPE) ** -0.5
    lens = [1, 3, 4, 5, 8, 17, 33]
    q, w_kc, w_vc, store, table, lengths = make_paged(lens, 20, g)
    latents = batch.PagedLatents(store, table, lengths, max(lens))
    kv = batch.gather_paged(store, table, lengths, max(lens))
    want = batch.absorbed_decode(q, kv, lengths, w_kc, w_vc, rope_dim=ROPE, scale=scale)
    assert torch.isfinite(want).all()
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :NOPE].float(), w_kc)

    def kernel(config: AbsorbedDecodeConfig, parts: int = 3) -> torch.Tensor:
        o_lat = absorbed_mla_decode(
            q_lat, q[..., NOPE:], store, table, lengths, scale,
            q_parts=parts, p_parts=parts, config=config,
        )  # fmt: skip
        return torch.einsum("bhl,hvl->bhv", o_lat, w_vc)

    # several key slices of 16 keys each, the combine taking 16 heads at a time, heads in N; and
    # one slice per 8 keys, one head per combine program, heads in M
    plans = [
        AbsorbedDecodeConfig(block_n=16, min_split_keys=16, combine_heads=16, heads_minor=True),
        AbsorbedDecodeConfig(block_n=8, min_split_keys=8, heads_minor=False),
    ]
    for config in plans:
        assert split_plan(len(lens), 2, table.shape[1] * R, config)[0] > 2
        err = rel_max_err(kernel(config), want)
        print(f"kernel vs torch pass ({config.heads_minor=}): rel max err {err:.2e}")
        assert err <= TOL, err
    err = rel_max_err(kernel(plans[0], parts=1), want)
    print(f"one bf16 rounding of q and p: rel max err {err:.2e}")
    assert err > 1e-4, err  # the parts are what makes the kernel exact
    # the model's entry point (q_lat formed inside) is the same kernel
    assert (
        rel_max_err(
            batch.absorbed_decode_paged(q, latents, w_kc, w_vc, rope_dim=ROPE, scale=scale), want
        )
        <= TOL
    )

    # a padding row (length 0) is zero; new lengths in the same tensor give the new answer
    lengths[2] = 0
    lengths[5] = 9
    got = kernel(plans[0])
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    live = [i for i in range(len(lens)) if i != 2]
    kv = batch.gather_paged(store, table, lengths, max(lens))
    want = batch.absorbed_decode(
        q[live], kv[live], lengths[live], w_kc, w_vc, rope_dim=ROPE, scale=scale
    )
    assert rel_max_err(got[live], want) <= TOL

    _layer_takes_kernel(batch)
    print("ABSORBED_INTERP_OK")


def _layer_takes_kernel(batch: object) -> None:
    """The bf16 NoPE MLA layer on paged latents: batched decode rows by the kernel == by the
    torch pass (to bf16 rounding of the output)."""
    from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig, MLASegment
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.mem_cache.block_pool import BlockPool
    from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
    from sglang.srt.mem_cache.paged_block_table import PagedBlockTable
    from sglang.srt.mem_cache.paged_rows import PagedRows

    hidden, lens, steps = 48, [2, 4, 6, 9], 3  # no 1-token prefill: that would decode too
    cfg = MLANoPEConfig(hidden, 3, 20, LAT, NOPE, ROPE, V, 1e-6)
    layer = MLANoPEAttention(cfg, LayerBuildSpec(dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            v = torch.rand(p.shape, generator=g) + 0.5 if "layernorm" in name else None
            v = v if v is not None else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(v.to(p.dtype))
    xs = [(torch.randn(sum(lens), hidden, generator=g) * 2).to(torch.bfloat16)]
    xs += [(torch.randn(len(lens), hidden, generator=g) * 2).to(torch.bfloat16)] * steps
    calls = []
    real = batch.absorbed_mla_decode

    def counting(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)

    batch.absorbed_mla_decode = counting
    outs = []
    for on in (True, False):
        layer.decode_kernel = on
        blocks = PagedBlockTable(BlockPool(32, R), rows=len(lens), max_tokens=64)
        store = torch.randn(33, R, LAT + ROPE, generator=g).to(torch.bfloat16)
        caches = [
            MLALatentCache(PagedRows(store, blocks.table[r], blocks.blocks(r)))
            for r in range(len(lens))
        ]
        got = []
        for k, x in enumerate(xs):
            seg_lens = lens if k == 0 else [1] * len(lens)
            segs, start = [], 0
            for r, n in enumerate(seg_lens):
                blocks.ensure(r, len(caches[r]) + n)
                segs.append(MLASegment(start, n, caches[r]))
                start += n
            with torch.no_grad():
                got.append(layer(x, segs).float())
        outs.append(torch.cat(got))
    batch.absorbed_mla_decode = real
    assert len(calls) == steps  # one kernel launch per decode forward, none for the prefill
    err = rel_max_err(outs[0], outs[1])
    print(f"layer, kernel vs torch pass: rel max err {err:.2e}")
    assert err < 2e-2, err


def test_kernel_under_interpreter() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    module = __name__.split(".")[-1]
    script = f"import sys; sys.path.insert(0, {here!r}); import {module} as t; t._interp_checks()"
    print(run_under_interpreter(marker="ABSORBED_INTERP_OK", code=script))


def test_widths_and_stores_it_refuses() -> None:
    assert absorbed_decode_unsupported(512, 64, torch.bfloat16) is None
    assert absorbed_decode_unsupported(512, 64, torch.float16) is None
    assert "bf16 or fp16" in str(absorbed_decode_unsupported(512, 64, torch.float32))
    assert "powers of two" in str(absorbed_decode_unsupported(32, 8, torch.bfloat16))
    q_lat, q_pe = torch.zeros(2, 4, 64), torch.zeros(2, 4, 16)
    store, lengths = torch.zeros(3, 4, 80, dtype=torch.bfloat16), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="store"):
        absorbed_mla_decode(
            q_lat, q_pe, store[..., :72], torch.zeros(2, 1, dtype=torch.long), lengths, 1.0
        )
    with pytest.raises(ValueError, match="table"):
        absorbed_mla_decode(q_lat, q_pe, store, torch.zeros(3, 1, dtype=torch.long), lengths, 1.0)
    with pytest.raises(ValueError, match="parts"):
        absorbed_mla_decode(
            q_lat, q_pe, store, torch.zeros(2, 1, dtype=torch.long), lengths, 1.0, q_parts=4
        )


def test_split_plan_covers_the_keys() -> None:
    config = AbsorbedDecodeConfig()
    for bs, groups, keys in [(1, 4, 8192), (16, 4, 8192), (64, 4, 8192), (3, 1, 5), (1, 1, 1)]:
        n, per = split_plan(bs, groups, keys, config)
        assert per % config.block_n == 0 and n * per >= keys > (n - 1) * per
        assert per >= min(config.min_split_keys, -(-keys // config.block_n) * config.block_n)
    assert split_plan(1, 4, 8192, config)[0] == 32  # bs 1: enough programs for the SMs
    assert split_plan(64, 4, 8192, config)[0] == 2


if __name__ == "__main__":
    run_this_file(__file__)
