"""Attention layers and their torch reference maths."""
