"""Sampling: request parameters (validated), logit processing and token selection."""
