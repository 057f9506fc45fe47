"""Kimi Delta Attention decode kernels: the short causal conv and the recurrent delta-rule step,
each one launch for every single-token row, updating per-request states in place."""
