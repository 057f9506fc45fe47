"""Checkpoint loading: config.json, safetensors, name maps, quantised formats, TP shards."""
