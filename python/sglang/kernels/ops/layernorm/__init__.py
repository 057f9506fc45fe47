"""Normalisation kernels (mHC hyper-connections for DeepSeek V4)."""
