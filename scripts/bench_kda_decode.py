"""The KDA decode kernels at Kimi K3's shape (96 heads of 128, conv width 4) on a GPU: the
recurrent step over a sweep of V-block sizes and warp counts, and the conv, each under CUDA-graph
replay, with the bandwidth they reach on the state bytes (read + written). States live apart, one
tensor per request, as the model keeps them. At batch 1 the states (6.3 MB) stay in L2.

Usage: python scripts/bench_kda_decode.py [--batch 1,16,64] [--heads 96] [--replays 20]
"""

from __future__ import annotations

import argparse

import torch

from sglang.kernels.ops.kda.conv_decode import kda_conv_decode_
from sglang.kernels.ops.kda.recurrent_step import default_block_v, kda_recurrent_step_
from sglang.kernels.ops.pointer_table import int64_on_device
from sglang.srt.utils.cuda_timing import median_graph_replay_ms

# (V rows a program, warp counts): a program holds a [block_v, 128] fp32 tile (4-16 KB).
CONFIGS = [(8, (1, 2)), (16, (1, 2, 4)), (32, (2, 4))]


def bench(batch: int, heads: int, dim: int, replays: int) -> None:
    gen = torch.Generator("cuda").manual_seed(batch)
    dev = torch.device("cuda")
    c = 3 * heads * dim
    conv_out = torch.randn(batch, c, generator=gen, device=dev).to(torch.bfloat16)
    q, k, v = (p.unflatten(-1, (heads, dim)) for p in conv_out.chunk(3, dim=-1))
    g = -torch.rand(batch, heads, dim, generator=gen, device=dev) * 2
    beta = torch.rand(batch, heads, generator=gen, device=dev)
    rows = torch.arange(batch, device=dev)
    states = [torch.randn(heads, dim, dim, generator=gen, device=dev) * 0.1 for _ in range(batch)]
    ptrs = int64_on_device([s.data_ptr() for s in states], dev)
    out = torch.empty(batch, heads, dim, device=dev)
    state_bytes = 2 * batch * states[0].numel() * 4
    default = default_block_v(dim)
    for block_v, warp_counts in CONFIGS:
        line = []
        for warps in warp_counts:

            def step(bv: int = block_v, nw: int = warps) -> None:
                kda_recurrent_step_(
                    q, k, v, g, beta, rows, ptrs, out,
                    l2norm_eps=1e-6, q_scale=dim**-0.5, block_v=bv, num_warps=nw,
                )  # fmt: skip

            ms = median_graph_replay_ms(step, replays)
            line.append(f"w{warps} {ms * 1e3:7.1f} us {state_bytes / ms / 1e6:6.0f} GB/s")
        mark = " (default)" if block_v == default else ""
        print(f"bs{batch:<3} step block_v {block_v:<2}{mark:<10} " + " | ".join(line), flush=True)
    x = torch.randn(batch, c, generator=gen, device=dev).to(torch.bfloat16)
    w = torch.randn(c, 4, generator=gen, device=dev)
    conv_states = [torch.randn(3, c, generator=gen, device=dev).to(x.dtype) for _ in range(batch)]
    conv_ptrs = int64_on_device([s.data_ptr() for s in conv_states], dev)
    y = torch.empty_like(x)
    ms = median_graph_replay_ms(lambda: kda_conv_decode_(x, w, rows, conv_ptrs, y), replays)
    print(f"bs{batch:<3} conv {ms * 1e3:7.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    for b in (int(b) for b in args.batch.split(",")):
        bench(b, args.heads, args.dim, args.replays)


if __name__ == "__main__":
    main()
