"""DeepSeek V4 compressor decode step under CUDA-graph replay: the torch path
(``compress_decode_torch``) against the fused kernel (``compress_decode_step`` on CUDA), for the
attention compressors (ratio 4 with overlap, ratio 128; D 512) and the indexer's (ratio 4, D 128),
bf16 entries, every row completing its block ("complete") or none ("none complete").

Usage (repo root, on a GPU): PYTHONPATH=python python scripts/bench_compressor_decode.py
"""

from __future__ import annotations

import functools

import torch

from sglang.srt.layers.attention.dsv4_static_compressor import (
    compress_decode_step,
    compress_decode_torch,
)
from sglang.srt.utils.cuda_timing import median_graph_replay_ms
from sglang.test.compressor_decode_cases import make_case


def main() -> None:
    for ratio, overlap, d in ((128, False, 512), (4, True, 512), (4, True, 128)):
        for bs in (1, 16, 64):
            case = make_case(ratio, overlap, d, torch.bfloat16, "cuda", seed=1, real_slots=bs)
            comp, st, tab, rot = case.compressor, case.store, case.table, case.rotary
            for s in range(bs):
                st.reset(s)
            slots = torch.arange(bs, device="cuda")
            w = comp.ape.shape[1]
            kv, sc = torch.randn(bs, w, device="cuda"), torch.randn(bs, w, device="cuda")
            res = []
            for label, p in (("complete", 8 * ratio - 1), ("none complete", 8 * ratio - 2)):
                pos = torch.full((bs,), p, device="cuda")
                args = (comp, st, kv, sc, pos, slots, tab, rot)
                t = median_graph_replay_ms(functools.partial(compress_decode_torch, *args), 50)
                k = median_graph_replay_ms(functools.partial(compress_decode_step, *args), 50)
                res.append(f"{label}: torch {t * 1e3:.1f} us kernel {k * 1e3:.1f} us")
            print(f"ratio {ratio} D {d} bs {bs}: " + "; ".join(res), flush=True)


if __name__ == "__main__":
    main()
