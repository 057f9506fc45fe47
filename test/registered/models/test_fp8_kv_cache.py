"""The FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) through the models and the engine, on CPU (the
torch paths: the kernels are checked in ``kernels/test_fp8_kv_cache_kernels.py``).

- The flag: refused by name when bad or with ``--dtype float16``; ``auto`` resolves per model and
  dtype (DeepSeek V4 in bf16: FP8, as DeepSeek's recipe; fp32: the model dtype; Kimi K3: the
  model dtype).
- Memory models for both dtypes, at DeepSeek V4-Flash's and Kimi K3's real widths: the bytes a
  cached token costs are the stored rows' (584-byte entries, 136-byte indexer keys, 648-byte
  latents), and ``--max-total-tokens`` grows by the same ratio.
- Tiny random models decoding through FP8 caches: every cache path a model has (per-request,
  slot pool) gives the same logits bit for bit (one encoding, the same torch
  ops), and the logits stay close to the bf16-cache run. Tolerance: quantising a cached row moves
  each value by up to 2^-4 relative, which these tiny random models (fp32, dense MoE routing so a
  flipped expert choice cannot dominate, an indexer top-k above the entry count) turn into
  per-row logit errors of ~1% median (measured DeepSeek V4 0.8%, Kimi K3 1.3%; running the whole
  model in bf16 instead moves them 2% / 5.5%): bounds are median row error 3% / 5%, mean KL
  5e-4 / 5e-3 nats, greedy agreement >= 90% / 85% of positions.
- The engine serving a tiny DeepSeek V4 and a tiny Kimi K3 (paged latents) with FP8 caches: it
  reports the layout, and its greedy tokens' log-probs (chunked prefill, then decode through the
  FP8 cache) are within 0.2 nats of the same tokens' under the bf16-cache model
  teacher-forced, each token within the reference's top 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.attention.dsv4_kv_layout import DeepseekV4KVLayout
from sglang.srt.layers.attention.mla_kv_layout import KimiK3KVLayout
from sglang.srt.mem_cache.kimi_k3_cache import KimiK3CacheShape
from sglang.srt.mem_cache.memory_models.deepseek_v4 import CacheShape
from sglang.srt.mem_cache.memory_models.kimi_k3 import KimiK3MemoryModel
from sglang.srt.model_executor.memory_budget import max_total_tokens_for_memory
from sglang.srt.models.deepseek_v4 import DeepseekV4Batch
from sglang.srt.models.kimi_k3 import KimiK3Batch
from sglang.srt.server_args import ServerArgs, ServerArgsError, parse_args
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, our_model, reference_model, token_ids
from sglang.test.kimi_k3_tiny import CONFIG_A as K3_CONFIG_A
from sglang.test.kimi_k3_tiny import VOCAB as K3_VOCAB
from sglang.test.kimi_k3_tiny import make_model, tokens
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=55)

# Dense MoE routing and an indexer top-k above the entry count (see the module docstring).
DSV4 = dict(CONFIG_A, index_topk=128, num_experts_per_tok=4)
K3 = dict(K3_CONFIG_A, num_experts_per_token=8)
# Prefill chunks past a ratio-128 block and the window, then decode steps.
CHUNKS = (100, 40) + (1,) * 4


# --- the flag ------------------------------------------------------------------------------------


def test_flag_is_validated_by_name() -> None:
    assert parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp8"])
    with pytest.raises(ServerArgsError, match="--kv-cache-dtype must be one of"):
        ServerArgs(kv_cache_dtype="int8", device="cpu").resolved().validate()
    with pytest.raises(ServerArgsError, match="--kv-cache-dtype fp8_e4m3 needs --dtype"):
        ServerArgs(kv_cache_dtype="fp8_e4m3", dtype="float16", device="cpu").validate()
    ServerArgs(kv_cache_dtype="auto", dtype="float16", device="cpu").validate()  # keeps fp16


def test_auto_follows_the_model_and_its_dtype() -> None:
    def dsv4(choice: str, dtype: torch.dtype) -> DeepseekV4KVLayout:
        return DeepseekV4KVLayout.build(
            head_dim=512, rope_dim=64, index_head_dim=128, dtype=dtype, kv_cache_dtype=choice
        )

    def k3(choice: str, dtype: torch.dtype) -> KimiK3KVLayout:
        return KimiK3KVLayout.build(
            kv_lora_rank=512, rope_dim=64, dtype=dtype, kv_cache_dtype=choice
        )

    bf16, fp32 = torch.bfloat16, torch.float32
    auto = dsv4("auto", bf16)
    assert auto.choice.fp8 and "DeepSeek's V4 inference recipe" in auto.choice.why
    assert (auto.entries.row_bytes, auto.index_keys.row_bytes, auto.window.row_bytes) == (
        584,
        136,
        1024,
    )
    assert not dsv4("auto", fp32).choice.fp8 and dsv4("fp8_e4m3", fp32).choice.fp8
    assert dsv4("bf16", bf16).entries.row_bytes == 1024
    assert not k3("auto", bf16).choice.fp8 and k3("auto", bf16).latents.row_bytes == 1152
    assert k3("fp8_e4m3", bf16).latents.row_bytes == 648
    assert "584 B" in auto.describe() and "136 B" in auto.describe()
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        dsv4("fp8_e4m3", torch.float16)


# --- memory models -------------------------------------------------------------------------------

# DeepSeek V4-Flash: 43 layers, 2 sliding, then ratio 4 and 128 alternating (21 and 20).
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
FLASH_KINDS = tuple({0: "sliding", 4: "csa", 128: "hca"}[r] for r in FLASH_RATIOS)


def _flash(entry_bytes: int | None, key_bytes: int | None) -> CacheShape:
    return CacheShape(
        num_layers=43, hidden_size=4096, hc_mult=4, vocab_size=129280, head_dim=512,
        index_head_dim=128, sliding_window=128, compress_ratios=FLASH_RATIOS,
        attn_types=FLASH_KINDS, dtype_bytes=2, entry_bytes=entry_bytes,
        index_key_bytes=key_bytes, kv_cache="fp8_e4m3" if entry_bytes else "bf16",
    )  # fmt: skip


def test_memory_models_count_the_stored_bytes() -> None:
    bf16, fp8 = _flash(None, None), _flash(584, 136)
    assert bf16.bytes_per_cached_token() == 21 * (1024 + 256) / 4 + 20 * 1024 / 128
    assert fp8.bytes_per_cached_token() == 21 * (584 + 136) / 4 + 20 * 584 / 128
    # the window rings are the model dtype either way
    assert fp8.window_bytes_per_request() == bf16.window_bytes_per_request() == 43 * 128 * 1024
    assert "ratio 4 + indexer 180.00 B" in fp8.describe()
    budget = {"room_bytes": 60 << 30, "max_running_requests": 64, "chunked_prefill_size": 8192,
              "context_length": 1 << 20, "max_logit_rows": 512}  # fmt: skip
    t16 = max_total_tokens_for_memory(bf16, **budget)
    t8 = max_total_tokens_for_memory(fp8, **budget)
    ratio = bf16.bytes_per_cached_token() / fp8.bytes_per_cached_token()
    assert ratio > 1.7 and abs(t8 / t16 - ratio) < 1e-3

    kinds = ("kda",) * 3 + ("mla",)
    pool = KimiK3CacheShape(kinds, kda_heads=12, kda_head_dim=128, conv_size=4, latent_dim=576)
    common: dict[str, Any] = {"pool": pool, "hidden_size": 7168, "vocab_size": 163840,
                              "bank_rows": 8, "dtype_bytes": 2, "state_dtype_bytes": 4}  # fmt: skip
    k16 = KimiK3MemoryModel(**common)
    k8 = KimiK3MemoryModel(**common, latent_row_bytes=648, kv_cache="fp8_e4m3")
    assert (k16.bytes_per_cached_token(), k8.bytes_per_cached_token()) == (1152, 648)
    assert (
        k8.null_block_bytes() == 256 * 648 and k8.request_state_bytes() == k16.request_state_bytes()
    )
    assert "648 B a row in the fp8_e4m3 KV cache" in k8.describe()


# --- tiny models ---------------------------------------------------------------------------------


def _logit_closeness(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(median row error max|d| / max|want|, mean KL(want || got) nats, greedy agreement)."""
    row = (got - want).abs().amax(-1) / want.abs().amax(-1)
    lw, lg = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lw.exp() * (lw - lg)).sum(-1)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    return float(row.median()), float(kl.mean()), float(agree)


def _run(model: Any, batch_type: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    out, pos = [], 0
    for n in CHUNKS:
        rows = torch.arange(pos, pos + n)
        out.append(model.forward(ids[pos : pos + n], rows, batch_type([n], [cache])))
        pos += n
    return torch.cat(out)


@torch.no_grad()
def test_deepseek_v4_decodes_through_fp8_caches() -> None:
    hf = reference_model(DSV4, seed=3)
    ids = token_ids(sum(CHUNKS), DSV4["vocab_size"], seed=1)
    ref = our_model(hf, kv_cache_dtype="bf16")
    want = _run(ref, DeepseekV4Batch, ref.new_request_cache(), ids)
    model = our_model(hf, kv_cache_dtype="fp8_e4m3")
    assert model.kv_layout.choice.fp8
    got = _run(model, DeepseekV4Batch, model.new_request_cache(), ids)
    model.enable_slot_pool(2, 512)
    pooled = model.new_pooled_cache()
    assert model.slot_pool is not None and model.slot_pool.layers[1].compressor is not None
    assert model.slot_pool.layers[1].compressor.entries.dtype == torch.uint8
    assert torch.equal(_run(model, DeepseekV4Batch, pooled, ids), got)
    median, kl, agree = _logit_closeness(got, want)
    assert median <= 0.03 and kl <= 5e-4 and agree >= 0.9, (median, kl, agree)


@torch.no_grad()
def test_kimi_k3_decodes_through_fp8_caches() -> None:
    ids = tokens(sum(CHUNKS), seed=3)
    ref = make_model(K3, seed=5)
    want = _run(ref, KimiK3Batch, ref.new_request_cache(), ids)
    model = make_model(K3, seed=5, kv_cache_dtype="fp8_e4m3")
    got = _run(model, KimiK3Batch, model.new_request_cache(), ids)
    model.enable_slot_pool(1, 512)
    assert torch.equal(_run(model, KimiK3Batch, model.new_pooled_cache(), ids), got)
    median, kl, agree = _logit_closeness(got, want)
    assert median <= 0.05 and kl <= 5e-3 and agree >= 0.85, (median, kl, agree)


# --- the engine ----------------------------------------------------------------------------------

TF_TOL = 0.2  # nats: a served token's log-prob against the bf16-cache model's, teacher-forced


def _serve_and_compare(
    engine_args: dict[str, Any], prompts: list[list[int]], reference: Any, batch_type: Any
) -> None:
    from sglang import Engine

    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(**engine_args, kv_cache_dtype="fp8_e4m3", log_level="warning") as engine:
        assert engine.get_server_info()["model_info"]["kv_cache_dtype"] == "fp8_e4m3"
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    for prompt, out in zip(prompts, outs, strict=True):
        served = out["output_ids"]
        assert len(served) == 6
        seq = torch.tensor(prompt + served)
        with torch.no_grad():
            logits = reference.forward(
                seq, torch.arange(len(seq)), batch_type([len(seq)], [reference.new_request_cache()])
            )
        lp = logits[len(prompt) - 1 : -1].log_softmax(-1)
        ranks = (lp > lp.gather(1, torch.tensor(served)[:, None])).sum(-1)
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        want = lp.gather(1, torch.tensor(served)[:, None])[:, 0]
        assert bool((ranks < 3).all()), ranks.tolist()
        assert float((got - want).abs().max()) <= TF_TOL, (got - want).tolist()


def test_engine_serves_deepseek_v4_with_fp8_caches(tmp_path: Path) -> None:
    hf = reference_model(DSV4, seed=4)
    hf.save_pretrained(tmp_path)
    prompts = [token_ids(n, DSV4["vocab_size"], seed=n).tolist() for n in (150, 40)]
    args = {"device": "cpu", "model_path": str(tmp_path), "skip_tokenizer_init": True,
            "chunked_prefill_size": 64, "moe_runner_backend": "torch"}  # fmt: skip
    _serve_and_compare(args, prompts, our_model(hf, kv_cache_dtype="bf16"), DeepseekV4Batch)


def test_engine_serves_kimi_k3_with_paged_fp8_latents(tmp_path: Path) -> None:
    src = make_model(K3, seed=11)
    k3_release.write_unquantised(tmp_path, K3, src)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, K3_VOCAB, (n,), generator=g).tolist() for n in (70, 9)]
    args = {"device": "cpu", "model_path": str(tmp_path), "skip_tokenizer_init": True,
            "chunked_prefill_size": 32, "moe_runner_backend": "torch", "max_total_tokens": 1024,
            "context_length": 256}  # fmt: skip
    _serve_and_compare(args, prompts, src, KimiK3Batch)


if __name__ == "__main__":
    run_this_file(__file__)
