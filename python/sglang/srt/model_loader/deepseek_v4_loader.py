"""Load a DeepSeek V4 model from a directory (config.json + safetensors) or from named tensors.

Every parameter of the model is looked up by its (release) name after mapping the checkpoint's
spelling (see ``deepseek_v4_names``); each parameter's ``weight_loader`` checks the full shape and
keeps this rank's shard. Formats:
- dense weights: bf16/fp32, or FP8 e4m3 with a 128x128 block scale (``.scale``, UE8M0 or fp32;
  also ``weight_scale_inv``), dequantised to the model dtype at load (the CPU/reference path; the
  maths then equals the dequantised checkpoint's);
- routed experts: per-expert ``w1``/``w2``/``w3`` (or transformers' stacked ``gate_up_proj`` /
  ``down_proj``) in bf16, FP8 128x128 (kept FP8 for the expert runners) or MXFP4 (packed bytes +
  UE8M0 scales per 32, dequantised), through ``expert_weights_from_checkpoint``.
A missing, mis-shaped or (with ``strict``) unexpected tensor raises :class:`WeightLoadError` naming
it. ``mtp.*`` tensors are skipped with one log line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.linear import WeightShapeError
from sglang.srt.layers.moe.expert_weights import (
    WeightFormat,
    expert_weights_from_checkpoint,
    stack_expert_tensors,
)
from sglang.srt.layers.moe.layer import A2ABackend
from sglang.srt.model_loader.deepseek_v4_names import canonical_name
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex as _Index
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.weight_source import (
    DictWeightSource,
    SafetensorsWeightSource,
    WeightSource,
)
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

FP8_BLOCK = (128, 128)
_FP8_DTYPES = (torch.float8_e4m3fn,)
_FP4_DTYPES = (torch.uint8, torch.int8)


def _build_index(source: WeightSource) -> _Index:
    by_canon: dict[str, str] = {}
    skipped = 0
    for name in source.names():
        canon = canonical_name(name)
        if canon is None:
            skipped += 1
            continue
        if canon in by_canon:
            raise WeightLoadError(
                f"checkpoint tensors {by_canon[canon]!r} and {name!r} both map to {canon!r}"
            )
        by_canon[canon] = name
    if skipped:
        logger.info(
            f"skipping {skipped} MTP tensors (mtp.*): the multi-token-prediction layer is not loaded"
        )
    return _Index(source, by_canon, set())


def _dense(index: _Index, canon: str) -> torch.Tensor:
    """A dense weight, FP8 block-dequantised to fp32 when it ships FP8."""
    w = index.get(canon)
    if w.dtype in _FP8_DTYPES:
        scale_name = (
            canon[: -len(".weight")] + ".scale" if canon.endswith(".weight") else canon + ".scale"
        )
        if not index.has(scale_name):
            raise WeightLoadError(
                f"FP8 tensor {index.ckpt_name(canon)!r} has no block scale {scale_name!r}"
            )
        scale = index.get(scale_name)
        try:
            w = block_dequant_fp8(w, scale.float(), FP8_BLOCK, dtype=torch.float32)
        except ValueError as exc:
            raise WeightLoadError(f"{index.ckpt_name(scale_name)!r}: {exc}") from None
    return w


def _load_param(index: _Index, canon: str, param: nn.Parameter) -> None:
    tensor = _dense(index, canon)
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


def _load_experts(index: _Index, model: DeepseekV4ForCausalLM, layer_id: int) -> None:
    c = model.config
    prefix = f"layers.{layer_id}.ffn.experts"
    fused = f"{prefix}.gate_up_proj"
    if index.has(fused):
        # transformers' in-memory layout: already stacked [E, 2I, H] (gate rows first) and [E, H, I]
        w13, w2 = index.get(fused), index.get(f"{prefix}.down_proj")
        s13 = s2 = None
        fmt = _expert_format(w13)
        if fmt is not WeightFormat.BF16:
            raise WeightLoadError(
                f"stacked expert tensors {fused!r} are only supported unquantised"
            )
    else:
        gate, up, down = [], [], []
        for e in range(c.n_routed_experts):
            gate.append(index.get(f"{prefix}.{e}.w1.weight"))
            up.append(index.get(f"{prefix}.{e}.w3.weight"))
            down.append(index.get(f"{prefix}.{e}.w2.weight"))
        fmt = _expert_format(gate[0])
        # Two FP4 values a byte: the packed K dim is halved.
        pack = 2 if fmt is WeightFormat.MXFP4 else 1
        h, inter = c.hidden_size, c.moe_intermediate_size
        for e in range(c.n_routed_experts):
            for w, t, want in (
                ("w1", gate[e], (inter, h // pack)),
                ("w3", up[e], (inter, h // pack)),
                ("w2", down[e], (h, inter // pack)),
            ):
                if tuple(t.shape) != want:
                    name = f"{prefix}.{e}.{w}.weight"
                    raise WeightLoadError(
                        f"tensor {index.ckpt_name(name)!r}: expected shape {want}, got {tuple(t.shape)}"
                    )
        scales: list[list[torch.Tensor]] = [[], [], []]
        if fmt is not WeightFormat.BF16:
            if fmt is WeightFormat.FP8 and c.moe_intermediate_size % FP8_BLOCK[0]:
                # gate and up are stacked on rows, so their 128-row scale blocks must not straddle
                raise WeightLoadError(
                    f"layer {layer_id}: FP8 experts need moe_intermediate_size "
                    f"({c.moe_intermediate_size}) divisible by {FP8_BLOCK[0]}"
                )
            for e in range(c.n_routed_experts):
                for i, w in enumerate(("w1", "w3", "w2")):
                    scale = index.get(f"{prefix}.{e}.{w}.scale")
                    # UE8M0 bytes are kept as such for MXFP4 (its dequant reads them raw)
                    scales[i].append(scale.float() if fmt is WeightFormat.FP8 else scale)
        try:
            w13, w2 = stack_expert_tensors(gate, up, down)
            s13, s2 = stack_expert_tensors(*scales) if scales[0] else (None, None)
        except RuntimeError as exc:  # torch.stack / cat on mismatched shapes
            raise WeightLoadError(
                f"layer {layer_id} experts have inconsistent shapes: {exc}"
            ) from None
    try:
        weights = expert_weights_from_checkpoint(fmt, w13, w2, s13, s2, dtype=model.dtype)
        model.decoder_layers[layer_id].ffn.experts.load_weights(weights)
    except (ValueError, TypeError) as exc:
        raise WeightLoadError(f"layer {layer_id} routed experts ({fmt.value}): {exc}") from None


def load_weights(
    model: DeepseekV4ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    progress: bool = True,
) -> None:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping)."""
    if isinstance(source, Mapping):
        source = DictWeightSource(source)
    index = _build_index(source)
    if (
        model.config.tie_word_embeddings
        and not index.has("head.weight")
        and index.has("embed.weight")
    ):
        # A tied checkpoint stores the table once; the LM head reads the same tensor.
        index.by_canon["head.weight"] = index.by_canon["embed.weight"]
    params = dict(model.named_parameters())
    hash_tables = {
        f"layers.{i}.ffn.gate.tid2eid": layer.ffn.gate
        for i, layer in enumerate(model.decoder_layers)
        if layer.ffn.is_hash
    }
    missing = [n for n in list(params) + list(hash_tables) if not index.has(n)]
    if missing:
        raise WeightLoadError(
            f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]} "
            f"(names after mapping to the release naming)"
        )
    steps = len(params) + len(hash_tables) + len(model.layers)
    with tqdm(
        total=steps, desc="Loading DeepSeek V4 weights", disable=not progress, unit="tensor"
    ) as bar:
        for name, param in params.items():
            _load_param(index, name, param)
            bar.update()
        for name, gate in hash_tables.items():
            try:
                gate.load_tid2eid(index.get(name))
            except WeightShapeError as exc:
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r} (model {name!r}): {exc}"
                ) from None
            bar.update()
        for i in range(len(model.layers)):
            _load_experts(index, model, i)
            bar.update()
    left = sorted(set(index.by_canon) - index.used)
    if left:
        msg = f"checkpoint has {len(left)} tensor(s) the model does not use, e.g. {[index.ckpt_name(n) for n in left[:5]]}"
        if strict:
            raise WeightLoadError(msg)
        logger.warning(msg)


def load_deepseek_v4(
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
) -> DeepseekV4ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    config = DeepseekV4ModelConfig.from_json_file(model_dir)
    model = DeepseekV4ForCausalLM(
        config, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size,
        moe_runner=moe_runner, a2a_backend=a2a_backend,
    )  # fmt: skip
    source = SafetensorsWeightSource(model_dir)
    try:
        load_weights(model, source, strict=strict, progress=progress)
    finally:
        source.close()
    return model.eval()
