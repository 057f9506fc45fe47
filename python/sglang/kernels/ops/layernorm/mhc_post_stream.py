"""One new residual stream of the mHC post, on a tile of tokens: shared by the Triton post,
fused post+pre and bf16-MMA mix kernels (the same code, so their outputs agree bit for bit)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, J: tl.constexpr):
    # New stream J: post_J * x + sum_k comb[k, J] * R_k (comb row k = old stream k).
    p = tl.load(post_ptr + offs_t * 4 + J, mask=mask_t, other=0.0).to(tl.float32)
    c0 = tl.load(comb_ptr + offs_t * 16 + 0 * 4 + J, mask=mask_t, other=0.0).to(tl.float32)
    c1 = tl.load(comb_ptr + offs_t * 16 + 1 * 4 + J, mask=mask_t, other=0.0).to(tl.float32)
    c2 = tl.load(comb_ptr + offs_t * 16 + 2 * 4 + J, mask=mask_t, other=0.0).to(tl.float32)
    c3 = tl.load(comb_ptr + offs_t * 16 + 3 * 4 + J, mask=mask_t, other=0.0).to(tl.float32)
    return (
        p[:, None] * xv + c0[:, None] * r0 + c1[:, None] * r1 + c2[:, None] * r2 + c3[:, None] * r3
    )
