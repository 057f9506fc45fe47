"""Dense GEMM kernels (block-FP8 W8A8)."""
