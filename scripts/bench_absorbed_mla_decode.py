"""Launch shapes of the absorbed MLA decode kernel (``kernels/ops/attention/
absorbed_mla_decode.py``) on the GPU: each config's CUDA-graph replay time at each batch size,
against the bytes of the latents it must read, and its error against the fp32 torch maths on
the same rows (and against fp64, to tell the torch path's own rounding from the kernel's).

K3's widths: 64 heads, latent 512 + rope 64, a paged bf16 store of blocks of 256 rows (shuffled),
every request at ``--context`` rows, fp32 ``q_lat`` (as the absorption makes it) and bf16
``q_pe``. A config is ``{m|n}G{group}N{block_n}w{warps}s{stages}``: ``m`` heads in the MMA's M
dimension, ``n`` in N (``heads_minor``); ``--parts`` lists the query / probability part counts
run with the first config (3/3 is exact).

Usage: python scripts/bench_absorbed_mla_decode.py [--batch 1,16,64] [--context 8192]
       [--configs n16x64w4s2,m16x64w8s2] [--parts 3/3,2/2]
"""

from __future__ import annotations

import argparse
import functools
import re

import torch

from sglang.kernels.ops.attention.absorbed_mla_decode import (
    AbsorbedDecodeConfig,
    absorbed_mla_decode,
)
from sglang.srt.utils.cuda_timing import median_graph_replay_ms

HEADS, LAT, ROPE, ROWS = 64, 512, 64, 256


def parse_config(spec: str) -> AbsorbedDecodeConfig:
    m = re.fullmatch(r"([mn])(\d+)x(\d+)w(\d+)s(\d+)", spec)
    if m is None:
        raise ValueError(f"config {spec!r} is not {{m|n}}<group>x<block_n>w<warps>s<stages>")
    side, group, block, warps, stages = m.groups()
    return AbsorbedDecodeConfig(
        group=int(group),
        block_n=int(block),
        num_warps=int(warps),
        num_stages=int(stages),
        heads_minor=side == "n",
    )


def inputs(bs: int, ctx: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    nb = -(-ctx // ROWS)
    store = (torch.randn(bs * nb + 1, ROWS, LAT + ROPE, generator=gen, device="cuda") * 0.5).to(
        torch.bfloat16
    )
    table = torch.randperm(bs * nb, generator=gen, device="cuda").view(bs, nb)
    lengths = torch.full((bs,), ctx, dtype=torch.long, device="cuda")
    q_lat = torch.randn(bs, HEADS, LAT, generator=gen, device="cuda")
    q_pe = torch.randn(bs, HEADS, ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    return q_lat, q_pe, store, table, lengths


def reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    kv = store[table].reshape(table.shape[0], -1, LAT + ROPE)[:, :ctx].to(dtype)
    ckv, kpe = kv.split([LAT, ROPE], dim=-1)
    s = (q_lat.to(dtype) @ ckv.transpose(1, 2) + q_pe.to(dtype) @ kpe.transpose(1, 2)) * scale
    return (torch.softmax(s, dim=-1) @ ckv).float()


Run = tuple[str, AbsorbedDecodeConfig, tuple[int, int]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def bench_batch(bs: int, ctx: int, runs: list[Run], replays: int, bandwidth: float) -> None:
    scale = 192**-0.5
    gen = torch.Generator("cuda").manual_seed(bs)
    q_lat, q_pe, store, table, lengths = inputs(bs, ctx, gen)
    ref = reference(q_lat, q_pe, store, table, ctx, scale)
    exact = reference(q_lat, q_pe, store, table, ctx, scale, torch.float64)
    print(f"bs {bs}: the fp32 torch maths vs fp64: rel max err {rel_err(ref, exact):.2e}")
    floor_us = bs * ctx * (LAT + ROPE) * 2 / bandwidth * 1e6
    for spec, cfg, (qp, pp) in runs:
        call = functools.partial(
            absorbed_mla_decode,
            q_lat,
            q_pe,
            store,
            table,
            lengths,
            scale,
            q_parts=qp,
            p_parts=pp,
            config=cfg,
        )
        try:
            out = call()
            err, err64 = rel_err(out, ref), rel_err(out, exact)
            us = median_graph_replay_ms(call, replays, rounds=3) * 1e3
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: go on
            print(f"{spec:<14} {qp}/{pp:<4} {bs:>4} failed: {type(e).__name__}: {e}"[:300])
            continue
        print(
            f"{spec:<14} {qp}/{pp:<4} {bs:>4} {us:>9.1f} {floor_us:>9.1f} "
            f"{us / floor_us:>8.2f} {err:>9.2e} {err64:>9.2e}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--configs", default="n16x64w4s2,m16x64w8s2,m16x32w4s2")
    p.add_argument("--parts", default="3/3")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=4.2e12)
    args = p.parse_args()
    specs = args.configs.split(",")
    runs: list[Run] = [(spec, parse_config(spec), (3, 3)) for spec in specs]
    for pp in args.parts.split(","):
        q_parts, p_parts = (int(x) for x in pp.split("/"))
        if (q_parts, p_parts) != (3, 3):
            runs.append((specs[0], runs[0][1], (q_parts, p_parts)))
    print(
        f"{'config':<14} {'parts':<6} {'bs':>4} {'us':>9} {'floor us':>9} {'x floor':>8} "
        f"{'vs fp32':>9} {'vs fp64':>9}"
    )
    for bs in (int(b) for b in args.batch.split(",")):
        bench_batch(bs, args.context, runs, args.replays, args.bandwidth)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
