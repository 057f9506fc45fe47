"""The built-in default model: what the server serves when no ``--model-path`` is given.

It is a *tiny DeepSeek V4-architecture model with random weights* (fixed seed) and a small
byte-level BPE tokenizer trained on a built-in paragraph. It produces gibberish text. It exists so
that ``python -m sglang.launch_server`` works on a fresh machine with no download, in seconds on a
CPU, and exercises the whole engine (hash routing, ratio-4 and ratio-128 compressed attention,
the indexer, mHC, MoE, tokenizer, chat template, sampling, streaming).

The files (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) are generated
deterministically into a cache directory on first use: ``sglang.srt.default_model.generate``.
"""
