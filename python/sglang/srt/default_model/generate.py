"""Generate the default model's files (config, random weights, tokenizer) into a cache directory.

Same inputs, same files: the weights come from one seeded CPU generator, walked in sorted name
order. The directory name carries a hash of everything that shapes the output (config, tokenizer,
generator version), so a change produces a new directory instead of a stale mix. Writing goes to a
temporary sibling that is renamed into place, so concurrent first starts (TP ranks, tests) never
see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_tokenizer,
    special_token_id,
    tokenizer_config,
)
from sglang.srt.environ import envs
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

DEFAULT_MODEL_NAME = "sglang-default-tiny-dsv4"
_GENERATOR_VERSION = 1
_SEED = 20260101
_READY = "READY"


def cache_root() -> Path:
    configured = envs.SGLANG_CACHE_DIR.get()
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "sglang" if xdg else Path.home() / ".cache" / "sglang"


def _expert_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    h, inter = int(config["hidden_size"]), int(config["moe_intermediate_size"])  # type: ignore[call-overload]
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        for e in range(int(config["n_routed_experts"])):  # type: ignore[call-overload]
            prefix = f"layers.{layer}.ffn.experts.{e}"
            shapes[f"{prefix}.w1.weight"] = (inter, h)
            shapes[f"{prefix}.w3.weight"] = (inter, h)
            shapes[f"{prefix}.w2.weight"] = (h, inter)
    return shapes


def parameter_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model expects, with its shape (dense params from a meta-device
    instance, so the names always track the model code)."""
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

    cfg = DeepseekV4ModelConfig.from_dict(config)
    model = DeepseekV4ForCausalLM(
        cfg, LayerBuildSpec(dtype=torch.float32, device="meta", moe_runner="torch")
    )
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes.update(_expert_shapes(config))
    return shapes


def random_weights(
    config: dict[str, object], seed: int = _SEED, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random but well-scaled weights: matrices ~ N(0, 1/fan_in), norm weights near 1, mHC scales
    near 1, other vectors small; hash-routing tables pick distinct experts per token. The float
    weights are drawn on ``device`` (a GPU draws a wide model's ~13 GB a layer in seconds, the CPU
    in about a minute; the values depend on the device's generator)."""
    g = torch.Generator().manual_seed(seed)
    draw = g if device == "cpu" else torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(parameter_shapes(config).items()):
        if len(shape) >= 2:
            t = torch.randn(shape, generator=draw, device=device) * shape[-1] ** -0.5
        elif name.endswith(("norm.weight", "_scale")):
            t = 1.0 + 0.1 * torch.randn(shape, generator=draw, device=device)
        else:
            t = 0.5 * torch.randn(shape, generator=draw, device=device)
        out[name] = t.to(torch.bfloat16)
    experts, top_k = int(config["n_routed_experts"]), int(config["num_experts_per_tok"])  # type: ignore[call-overload]
    vocab = int(config["vocab_size"])  # type: ignore[call-overload]
    for layer in range(int(config["num_hash_layers"])):  # type: ignore[call-overload]
        rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(vocab)]
        out[f"layers.{layer}.ffn.gate.tid2eid"] = torch.stack(rows).to(torch.int32)
    return out


def _fingerprint(config: dict[str, object], tokenizer_json: str) -> str:
    h = hashlib.sha256()
    h.update(f"v{_GENERATOR_VERSION}/{_SEED}/{torch.__version__.split('+')[0]}".encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    h.update(tokenizer_json.encode())
    return h.hexdigest()[:12]


def _write(path: Path, config: dict[str, object], tokenizer_json: str) -> None:
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(path / "tokenizer.json", "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2)
    with open(path / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f
        )
    save_file(random_weights(config), str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "README.md", "w", encoding="utf-8") as f:
        f.write(
            f"# {DEFAULT_MODEL_NAME}\n\nGenerated by sglang: a tiny DeepSeek V4-architecture model "
            "with RANDOM weights (fixed seed). Its output is gibberish; it exists to exercise the "
            "serving engine without a download.\n"
        )
    (path / _READY).write_text("ok\n")


def ensure_default_model(root: str | os.PathLike[str] | None = None) -> str:
    """The default model's directory (config.json + model.safetensors + tokenizer files),
    generating it on first use. Safe to call from several processes at once."""
    tok = build_tokenizer()
    tokenizer_json = tok.to_str()
    config = default_model_config(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=special_token_id(BOS_TOKEN),
        eos_token_id=special_token_id(EOS_TOKEN),
    )
    base = Path(root) if root is not None else cache_root()
    target = base / f"{DEFAULT_MODEL_NAME}-{_fingerprint(config, tokenizer_json)}"
    if (target / _READY).exists():
        return str(target)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base))
    try:
        logger.info(f"generating the built-in default model (random weights) in {target}")
        _write(tmp, config, tokenizer_json)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (the target exists and is complete), or a stale
            # incomplete directory is in the way: replace that one.
            if not (target / _READY).exists():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
