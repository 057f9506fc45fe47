"""Model execution on one TP rank: loading, per-request caches, the forward of a batch plan."""
