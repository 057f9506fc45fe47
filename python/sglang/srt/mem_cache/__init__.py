"""Per-request model state (KV windows, compressed entries, compressor state)."""
