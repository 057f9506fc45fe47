"""Request management: tokenizer manager (main process), scheduler (one per TP rank), the
messages between them, and the process launcher."""
