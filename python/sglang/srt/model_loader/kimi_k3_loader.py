"""Load a Kimi K3 model from a directory (config.json + safetensors) or from named tensors.

Every parameter is looked up by its model name after mapping the checkpoint's spelling (see
``kimi_k3_names``); each parameter's ``weight_loader`` checks the full shape and keeps this rank's
shard (TP: heads / intermediate rows; fp32 KDA tensors stay fp32). Routed experts:
- per-expert ``experts.E.w1|w2|w3`` in bf16, MXFP4 (``weight_packed`` two E2M1 values a byte +
  ``weight_scale`` one UE8M0 byte per 32, dequantised to the model dtype), or FP8 with 128x128
  block scales (``weight_scale_inv``), or transformers' stacked ``gate_up_proj`` / ``down_proj``;
- stacked as ``w13 = [w1; w3]`` and handed to ``FusedMoE.load_weights``, which keeps this rank's
  part (TP: a slice of the intermediate dim; MegaMoE: whole experts);
- with ``mega_weight_builder`` (MegaMoE), this rank's raw stacked expert tensors are also handed to
  the builder (e.g. DeepGEMM's weight transform) and the result set as the layer's MegaMoE weights.
A missing, mis-shaped, wrongly typed or (with ``strict``) unexpected tensor raises
:class:`WeightLoadError` naming it. Vision tensors, and layers past ``num_hidden_layers`` (MTP),
are skipped with one log line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sglang.srt.layers.linear import WeightShapeError
from sglang.srt.layers.moe.expert_weights import (
    WeightFormat,
    expert_weights_from_checkpoint,
    stack_expert_tensors,
)
from sglang.srt.layers.moe.layer import A2ABackend
from sglang.srt.layers.quantization.mxfp4 import MXFP4_GROUP
from sglang.srt.model_loader.kimi_k3_names import canonical_name, layer_of
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex as _Index
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.weight_source import (
    DictWeightSource,
    SafetensorsWeightSource,
    WeightSource,
)
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_FP4_DTYPES = (torch.uint8, torch.int8)
_FP8_DTYPES = (torch.float8_e4m3fn,)
_FP8_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")

# (layer id, this rank's raw stacked experts: w13, w2 and their scales or None) -> MegaMoE weights
MegaWeightBuilder = Callable[[int, dict[str, torch.Tensor | None]], Any]


def _build_index(source: WeightSource, num_layers: int) -> _Index:
    by_canon: dict[str, str] = {}
    skipped_vision = skipped_layers = 0
    for name in source.names():
        canon = canonical_name(name)
        if canon is None:
            skipped_vision += 1
            continue
        layer = layer_of(canon)
        if layer is not None and layer >= num_layers:
            skipped_layers += 1
            continue
        if canon in by_canon:
            raise WeightLoadError(
                f"checkpoint tensors {by_canon[canon]!r} and {name!r} both map to {canon!r}"
            )
        by_canon[canon] = name
    if skipped_vision:
        logger.info(f"skipping {skipped_vision} vision tower / projector tensors: text-only model")
    if skipped_layers:
        logger.info(
            f"skipping {skipped_layers} tensors of layers >= num_hidden_layers={num_layers} (e.g. MTP)"
        )
    return _Index(source, by_canon, set())


def _load_param(index: _Index, canon: str, param: nn.Parameter) -> None:
    tensor = index.get(canon)
    if not tensor.dtype.is_floating_point or tensor.dtype in _FP8_DTYPES:
        raise WeightLoadError(
            f"tensor {index.ckpt_name(canon)!r} is {tensor.dtype}: only the routed experts may be quantised"
        )
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightShapeError(
                    f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
        else:
            loader(param, tensor)
    except WeightShapeError as exc:
        raise WeightLoadError(
            f"tensor {index.ckpt_name(canon)!r} (model {canon!r}): {exc}"
        ) from None


def _expert_format(w: torch.Tensor) -> WeightFormat:
    if w.dtype in _FP4_DTYPES:
        return WeightFormat.MXFP4
    if w.dtype in _FP8_DTYPES:
        return WeightFormat.FP8
    return WeightFormat.BF16


def _expert_scale(index: _Index, weight_name: str, fmt: WeightFormat) -> torch.Tensor:
    base = weight_name.removesuffix(".weight")
    suffixes = (".weight_scale",) if fmt is WeightFormat.MXFP4 else _FP8_SCALE_SUFFIXES
    for suffix in suffixes:
        if index.has(base + suffix):
            scale = index.get(base + suffix)
            return scale if fmt is WeightFormat.MXFP4 else scale.float()
    raise WeightLoadError(
        f"{fmt.value} expert tensor {index.ckpt_name(weight_name)!r} has no scale ({' or '.join(base + s for s in suffixes)})"
    )


def _read_experts(
    index: _Index, prefix: str, num_experts: int, hidden: int, inter: int
) -> tuple[WeightFormat, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Stacked ``(format, w13, w2, w13_scale, w2_scale)`` of one layer, shape-checked by name."""
    fused = f"{prefix}.gate_up_proj"
    if index.has(fused):
        # transformers' in-memory layout: already stacked [E, 2I, H] (gate rows first) and [E, H, I]
        w13, w2 = index.get(fused), index.get(f"{prefix}.down_proj")
        if _expert_format(w13) is not WeightFormat.BF16:
            raise WeightLoadError(
                f"stacked expert tensors {index.ckpt_name(fused)!r} are only supported unquantised"
            )
        return WeightFormat.BF16, w13, w2, None, None
    per: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    scales: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    fmt: WeightFormat | None = None
    for e in range(num_experts):
        for w in ("w1", "w3", "w2"):
            name = f"{prefix}.{e}.{w}.weight"
            t = index.get(name)
            this = _expert_format(t)
            fmt = this if fmt is None else fmt
            if this is not fmt:
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r} is {t.dtype}; the layer's experts are {fmt.value}"
                )
            pack = 2 if fmt is WeightFormat.MXFP4 else 1
            rows, cols = (hidden, inter) if w == "w2" else (inter, hidden)
            if tuple(t.shape) != (rows, cols // pack):
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r}: expected shape {(rows, cols // pack)}, got {tuple(t.shape)}"
                )
            per[w].append(t)
            if fmt is not WeightFormat.BF16:
                s = _expert_scale(index, name, fmt)
                if fmt is WeightFormat.MXFP4 and tuple(s.shape) != (rows, cols // MXFP4_GROUP):
                    raise WeightLoadError(
                        f"scale of {index.ckpt_name(name)!r}: expected shape {(rows, cols // MXFP4_GROUP)}, "
                        f"got {tuple(s.shape)}"
                    )
                scales[w].append(s)
    assert fmt is not None
    w13, w2 = stack_expert_tensors(per["w1"], per["w3"], per["w2"])
    if fmt is WeightFormat.BF16:
        return fmt, w13, w2, None, None
    s13, s2 = stack_expert_tensors(scales["w1"], scales["w3"], scales["w2"])
    return fmt, w13, w2, s13, s2


def _load_experts(
    index: _Index,
    model: KimiK3ForCausalLM,
    layer_id: int,
    mega_weight_builder: MegaWeightBuilder | None,
) -> None:
    moe = model.decoder_layers[layer_id].mlp
    assert isinstance(moe, KimiK3MoE)
    cfg = moe.experts.config
    prefix = f"model.layers.{layer_id}.mlp.experts"
    fmt, w13, w2, s13, s2 = _read_experts(
        index, prefix, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    )
    try:
        moe.experts.load_weights(
            expert_weights_from_checkpoint(fmt, w13, w2, s13, s2, dtype=model.dtype)
        )
    except (ValueError, TypeError) as exc:
        raise WeightLoadError(f"layer {layer_id} routed experts ({fmt.value}): {exc}") from None
    if mega_weight_builder is not None and moe.expert_parallel:
        local = moe.experts.local_experts
        raw = {
            "w13": w13[local.start : local.stop],
            "w2": w2[local.start : local.stop],
            "w13_scale": None if s13 is None else s13[local.start : local.stop],
            "w2_scale": None if s2 is None else s2[local.start : local.stop],
        }
        moe.experts.set_mega_weights(mega_weight_builder(layer_id, raw))


def load_weights(
    model: KimiK3ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    progress: bool = True,
    mega_weight_builder: MegaWeightBuilder | None = None,
) -> None:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping)."""
    if isinstance(source, Mapping):
        source = DictWeightSource(source)
    c = model.config
    index = _build_index(source, c.num_hidden_layers)
    if (
        c.tie_word_embeddings
        and not index.has("lm_head.weight")
        and index.has("model.embed_tokens.weight")
    ):
        # A tied checkpoint stores the table once; the LM head reads the same tensor.
        index.by_canon["lm_head.weight"] = index.by_canon["model.embed_tokens.weight"]
    params = dict(model.named_parameters())
    missing = [n for n in params if not index.has(n)]
    if missing:
        raise WeightLoadError(
            f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]} (model names; the checkpoint may "
            f"spell them language_model.model.layers.N..., with block_sparse_moe for mlp)"
        )
    moe_layers = [
        i for i, layer in enumerate(model.decoder_layers) if isinstance(layer.mlp, KimiK3MoE)
    ]
    with tqdm(total=len(params) + len(moe_layers), desc="Loading Kimi K3 weights", disable=not progress,
              unit="tensor") as bar:  # fmt: skip
        for name, param in params.items():
            _load_param(index, name, param)
            bar.update()
        for i in moe_layers:
            _load_experts(index, model, i, mega_weight_builder)
            bar.update()
    left = sorted(set(index.by_canon) - index.used)
    if left:
        msg = f"checkpoint has {len(left)} tensor(s) the model does not use, e.g. {[index.ckpt_name(n) for n in left[:5]]}"
        if strict:
            raise WeightLoadError(msg)
        logger.warning(msg)


def load_kimi_k3(
    model_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    moe_runner: str = "auto",
    a2a_backend: A2ABackend = "none",
    strict: bool = True,
    progress: bool = True,
    mega_weight_builder: MegaWeightBuilder | None = None,
) -> KimiK3ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    config = KimiK3Config.from_json_file(model_dir)
    model = KimiK3ForCausalLM(
        config, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size, moe_runner=moe_runner,
        a2a_backend=a2a_backend,
    )  # fmt: skip
    source = SafetensorsWeightSource(model_dir)
    try:
        load_weights(
            model, source, strict=strict, progress=progress, mega_weight_builder=mega_weight_builder
        )
    finally:
        source.close()
    return model.eval()
