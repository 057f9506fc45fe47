"""Kimi K3's MLA prefill attention (expanded K/V: q and k 192 wide, v 128, causal, bottom-right
aligned when the prompt continues a cached prefix) through torch SDPA, per form and backend, on
one GPU: the 3-D boolean-masked call the layer made before (SDPA's fused kernels refuse 3-D
inputs, so it ran the math path), the same mask in 4-D, ``is_causal`` / ``causal_lower_right`` in
4-D with SDPA's own pick and with each backend forced, v zero-padded to 192, and the layer's
``causal_prefill_attention`` (flash over the padded v).
``TFLOP/s`` counts the causal half only (2 * h * (qk + v) FLOPs a query-key pair seen).
``err``: largest difference from the masked form over its largest entry.

``--first-calls N``: instead, the first call at each of N new prompt lengths per form (cuDNN
builds a plan per shape; the others do not), host wall time, synchronised.

Usage: python scripts/bench_mla_prefill.py [--tokens 8192] [--prefix 0,4096] [--heads 64,8]
       [--first-calls 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from sglang.srt.layers.attention.mla_nope import causal_prefill_attention
from sglang.srt.utils.cuda_timing import median_cuda_ms

QK, V = 192, 128


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    n, s = q.shape[-2], k.shape[-2]
    allowed = (
        torch.arange(s, device=q.device)[None, :]
        <= (prefix + torch.arange(n, device=q.device))[:, None]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=QK**-0.5)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=QK**-0.5)
    bias = causal_lower_right(q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=QK**-0.5)


def _padded_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    return _causal(q, k, F.pad(v, (0, QK - V)), prefix)[..., :V]


def _forced(backend: SDPBackend, fn: Callable[..., torch.Tensor], *a: object) -> torch.Tensor:
    with sdpa_kernel([backend]):
        return fn(*a)


def first_calls(count: int, heads: int) -> None:
    """Milliseconds of the first call at each of ``count`` new lengths, per form."""
    import time

    gen = torch.Generator("cuda").manual_seed(1)
    forms = {
        "causal, SDPA's pick": partial(_causal),
        "causal, cudnn": partial(_forced, SDPBackend.CUDNN_ATTENTION, _causal),
        "v padded, flash": partial(_forced, SDPBackend.FLASH_ATTENTION, _padded_v),
        "causal, efficient": partial(_forced, SDPBackend.EFFICIENT_ATTENTION, _causal),
    }
    warm = [torch.randn(1, heads, 512, d, device="cuda").bfloat16() for d in (QK, QK, V)]
    for fn in forms.values():
        fn(*warm, 0)  # libraries loaded, kernels resident: only new-shape costs remain
    for i, (label, fn) in enumerate(forms.items()):
        times = []
        for j in range(count):
            n = 1000 + 97 * j + 7 * i  # lengths no form has seen
            q = torch.randn(1, heads, n, QK, generator=gen, device="cuda").bfloat16()
            k = torch.randn(1, heads, n, QK, generator=gen, device="cuda").bfloat16()
            v = torch.randn(1, heads, n, V, generator=gen, device="cuda").bfloat16()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            fn(q, k, v, 0)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - begin) * 1e3)
        print(f"first calls, {label:<18}: " + " ".join(f"{t:.1f}" for t in times) + " ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prefix", default="0,4096")
    parser.add_argument("--heads", default="64,8")
    parser.add_argument("--first-calls", type=int, default=0)
    args = parser.parse_args()
    if args.first_calls:
        first_calls(args.first_calls, int(args.heads.split(",")[0]))
        return
    print(f"\nK3 MLA prefill attention (qk {QK}, v {V}, bf16), {torch.cuda.get_device_name()}")
    print(f"{'n':>6} {'prefix':>6} {'h':>3} {'form':<26} {'ms':>9} {'TFLOP/s':>8} {'err':>9}")
    gen = torch.Generator("cuda").manual_seed(0)
    n = args.tokens
    for prefix in (int(p) for p in args.prefix.split(",")):
        for h in (int(x) for x in args.heads.split(",")):
            s = prefix + n
            q = torch.randn(1, h, n, QK, generator=gen, device="cuda").bfloat16()
            k = torch.randn(1, h, s, QK, generator=gen, device="cuda").bfloat16()
            v = torch.randn(1, h, s, V, generator=gen, device="cuda").bfloat16()
            pairs = n * prefix + n * (n + 1) / 2
            tflop = 2 * h * (QK + V) * pairs / 1e12
            want = _masked(q[0], k[0], v[0], prefix).float()
            forms: list[tuple[str, Callable[[], torch.Tensor]]] = [
                ("3-D mask (before)", partial(_masked, q[0], k[0], v[0], prefix)),
                ("4-D mask", partial(_masked, q, k, v, prefix)),
                ("causal, SDPA's pick", partial(_causal, q, k, v, prefix)),
                ("the layer (now)", partial(causal_prefill_attention, q, k, v, prefix, QK**-0.5)),
            ]
            for name, backend in (
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("flash", SDPBackend.FLASH_ATTENTION),
            ):
                forms.append(
                    (f"causal, {name}", partial(_forced, backend, _causal, q, k, v, prefix))
                )
                padded = partial(_forced, backend, _padded_v, q, k, v, prefix)
                forms.append((f"v padded, {name}", padded))
            for label, fn in forms:
                try:
                    got = fn().float().reshape(want.shape)
                    err = float((got - want).abs().max() / want.abs().max())
                    ms = median_cuda_ms(fn, repeats=5)
                except RuntimeError as e:
                    print(f"{n:>6} {prefix:>6} {h:>3} {label:<26} unavailable: {str(e)[:60]}")
                    continue
                print(f"{n:>6} {prefix:>6} {h:>3} {label:<26} {ms:>9.3f} {tflop / ms * 1e3:>8.1f} "
                      f"{err:>9.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
