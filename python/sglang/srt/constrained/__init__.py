"""Structured output with xgrammar: grammar specs from requests, their checks and limits, the
tokenizer's vocabulary as xgrammar sees it, compilation off the event loop and off the scheduler
loop with a cache, and the per-request matcher that masks each step's logits."""
