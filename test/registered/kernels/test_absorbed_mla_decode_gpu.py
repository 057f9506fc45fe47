"""Kimi K3's absorbed MLA decode kernel on a GPU (skipped elsewhere) at K3's widths (latent 512,
rope 64, nope 128, value 128) against the torch batched pass it replaces (``absorbed_decode``
over ``gather_paged``, fp32), on fresh random bf16 latents in a shuffled block store.

- 64 heads (one rank) and 8 (a TP slice: the head group padded), blocks of 256 rows (the
  latent pool's) and of 16 (tiles cross blocks): lengths 1, around the block edges, 1000, 4097
  and 8192, and NaN in every row past a length and in the null block. Both MMA orientations;
  exact parts, so only the fp32 summation order differs: bound 1e-5.
- Captured in a CUDA graph and replayed with new lengths (one of them 0, a padding row) and new
  queries in the same tensors: equal to eager calls, bit for bit (lengths and table are read
  from device memory).
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.attention.absorbed_mla_decode import (
    AbsorbedDecodeConfig,
    absorbed_mla_decode,
)
from sglang.srt.layers.attention import mla_absorbed_batch as batch
from sglang.test.ci_register import register_cuda_ci
from sglang.test.paged_mla_cases import make_paged
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_max_err

register_cuda_ci(est_time=25, suite="h200-1gpu")

pytestmark = pytest.mark.gpu
TOL = 1e-5
DIMS = (512, 64, 128, 128)  # latent, rope, nope, value
SCALE = (128 + 64) ** -0.5
LENS = [1, 255, 256, 257, 1000, 4097, 8192, 17]


@pytest.mark.parametrize("heads,rows", [(64, 256), (8, 16)])
@pytest.mark.parametrize("heads_minor", [True, False])
def test_kernel_matches_torch_pass(heads: int, rows: int, heads_minor: bool) -> None:
    g = torch.Generator().manual_seed(heads + rows)
    q, w_kc, w_vc, store, table, lengths = make_paged(
        LENS, heads, g, device="cuda", rows=rows, dims=DIMS
    )
    kv = batch.gather_paged(store, table, lengths, max(LENS))
    want = batch.absorbed_decode(q, kv, lengths, w_kc, w_vc, rope_dim=DIMS[1], scale=SCALE)
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., : DIMS[2]].float(), w_kc)
    config = AbsorbedDecodeConfig(heads_minor=heads_minor)
    o_lat = absorbed_mla_decode(
        q_lat, q[..., DIMS[2] :], store, table, lengths, SCALE, config=config
    )
    got = torch.einsum("bhl,hvl->bhv", o_lat, w_vc)
    assert torch.isfinite(got).all()
    err = rel_max_err(got, want)
    print(f"kernel vs torch pass, {heads} heads, blocks of {rows}, {heads_minor=}: {err:.2e}")
    assert err <= TOL, err
    latents = batch.PagedLatents(store, table, lengths, max(LENS))
    paged = batch.absorbed_decode_paged(q, latents, w_kc, w_vc, rope_dim=DIMS[1], scale=SCALE)
    assert rel_max_err(paged, want) <= TOL


def test_graph_replay_reads_lengths_from_device() -> None:
    g = torch.Generator().manual_seed(7)
    q, w_kc, _, store, table, lengths = make_paged(LENS, 64, g, device="cuda", dims=DIMS)
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., : DIMS[2]].float(), w_kc)
    q_pe = q[..., DIMS[2] :].contiguous()

    def call() -> torch.Tensor:
        return absorbed_mla_decode(q_lat, q_pe, store, table, lengths, SCALE)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(3):
        # within each request's rows (NaN lies past them), one a padding row
        new = [1, 200 - step, 0, 257 - step, 999, 4000 + step, 8192 - step, 3 + step]
        lengths.copy_(torch.tensor(new))
        q_lat.copy_(torch.randn(q_lat.shape, generator=g).to(q_lat.device))
        graph.replay()
        eager = call()
        assert torch.equal(out, eager), step
        assert torch.equal(out[2], torch.zeros_like(out[2]))  # the padding row
    del graph


if __name__ == "__main__":
    run_this_file(__file__)
