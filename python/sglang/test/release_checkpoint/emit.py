"""Turning tensor specs into a release checkpoint: draw or take each tensor, quantise it in its
spec's format, write the file tensors (safetensors shards + index, or an in-memory dict) and
record what each quantised tensor stands for.

Two sources of values, one path after them:
- :func:`given_source`: a state dict in the release's logical names (unquantised values, e.g. a
  reference model's parameters mapped to release names), quantised here;
- :func:`random_source`: every tensor drawn at random with its spec's :class:`Init`, on any
  device (a real-width checkpoint is drawn and quantised on the GPU, then copied to the host one
  tensor at a time and written).
Routed experts of one projection of one layer are drawn and quantised together, a slab of
experts at a time.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from sglang.test.release_checkpoint.formats import (
    dequant_fp8_block,
    dequant_mxfp4_rows,
    pow2_to_ue8m0,
    quant_fp8_block,
    quant_mxfp4_rows,
)
from sglang.test.release_checkpoint.layout import (
    SCALE_GROUP,
    CheckpointLayout,
    Format,
    TensorEntry,
    TensorSpec,
)
from sglang.test.release_checkpoint.shards import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter

# Elements of one stack slab (drawn in fp32, then quantised): ~0.5 GB, so a real-width layer's
# 256 or 896 experts go through the GPU in slabs.
SLAB_ELEMENTS = 1 << 27

Draw = Callable[[Sequence[TensorSpec]], torch.Tensor]


@dataclass(frozen=True, eq=False)
class ReleaseCheckpoint:
    """A checkpoint written to ``path``: its ``config.json`` contents, every file tensor with its
    bytes (``layout``: by group, whole or one rank's share) and, unless the writer was told not
    to keep them, ``values``: the fp32 value of every tensor as the model sees it (quantised ones
    dequantised), keyed by the unquantised release name (integer tables as stored)."""

    path: Path
    config: Mapping[str, Any]
    layout: CheckpointLayout
    values: Mapping[str, torch.Tensor] | None


@dataclass(frozen=True, eq=False)
class ReleaseTensors:
    """The same checkpoint in memory: file tensor name -> tensor, plus layout and values."""

    tensors: Mapping[str, torch.Tensor]
    layout: CheckpointLayout
    values: Mapping[str, torch.Tensor]


# --- sources -------------------------------------------------------------------------------------


def given_source(tensors: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> Draw:
    """Take each spec's tensor from ``tensors`` (names and shapes checked against the specs)."""
    want = {s.name: s.shape for s in specs}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(
            f"the state dict does not match the release layout: missing {missing[:8]} "
            f"({len(missing)}), unexpected {extra[:8]} ({len(extra)})"
        )
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, the release layout "
                f"needs {shape}"
            )

    def draw(chunk: Sequence[TensorSpec]) -> torch.Tensor:
        return torch.stack([tensors[s.name].detach() for s in chunk])

    return draw


def random_source(seed: int, device: str | torch.device) -> Draw:
    """Draw each spec at random with its :class:`Init` on ``device`` (one generator, walked in
    spec order: same seed and device, same values)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(chunk: Sequence[TensorSpec]) -> torch.Tensor:
        spec = chunk[0]
        shape = (len(chunk), *spec.shape)
        init = spec.init
        if init.kind == "hash":
            scores = torch.rand((*shape[:-1], int(init.a)), generator=gen, device=device)
            return scores.argsort(-1)[..., : shape[-1]].to(torch.int32)
        if init.kind == "normal":
            return init.a + init.b * torch.randn(shape, generator=gen, device=device)
        if init.kind == "uniform":
            return init.a + (init.b - init.a) * torch.rand(shape, generator=gen, device=device)
        if init.kind != "fan_in":
            raise ValueError(f"{spec.name}: unknown init {init.kind!r}")
        w = torch.randn(shape, generator=gen, device=device) * (init.b * shape[-1] ** -0.5)
        return _vary_blocks(w, spec.fmt, gen)

    return draw


def _vary_blocks(w: torch.Tensor, fmt: Format, gen: torch.Generator) -> torch.Tensor:
    """Scale each quantisation block by 2^U(-1, 1), so neighbouring blocks need other scales."""
    if fmt is Format.MXFP4:
        groups = w.unflatten(-1, (w.shape[-1] // 32, 32))
        factor = torch.rand((*groups.shape[:-1], 1), generator=gen, device=w.device)
        return (groups * torch.exp2(2 * factor - 1)).flatten(-2)
    if fmt is Format.FP8_BLOCK:
        n, k = w.shape[-2:]
        nb, kb = -(-n // 128), -(-k // 128)
        factor = torch.rand((*w.shape[:-2], nb, kb), generator=gen, device=w.device)
        rows = factor.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)
        return w * torch.exp2(2 * rows[..., :k] - 1)
    return w


def with_fallback(primary: Draw, fallback: Draw, use_fallback: Callable[[str], bool]) -> Draw:
    """``fallback`` for the specs ``use_fallback`` picks by name (e.g. the MTP layer a reference
    model lacks), ``primary`` for the rest."""

    def draw(chunk: Sequence[TensorSpec]) -> torch.Tensor:
        return (fallback if use_fallback(chunk[0].name) else primary)(chunk)

    return draw


def given_else_random(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    drawn_at_random: Callable[[str], bool],
    seed: int,
) -> Draw:
    """The specs ``drawn_at_random`` picks by name drawn from ``seed`` on the device of
    ``tensors``, every other one taken from ``tensors`` (which must hold exactly those)."""
    given = given_source(tensors, [s for s in specs if not drawn_at_random(s.name)])
    device = next(iter(tensors.values())).device
    return with_fallback(given, random_source(seed, device), drawn_at_random)


# --- quantise and write --------------------------------------------------------------------------


def _slabs(specs: Iterable[TensorSpec]) -> Iterator[list[TensorSpec]]:
    """Consecutive specs of one stack, at most SLAB_ELEMENTS at a time; other specs alone."""
    run: list[TensorSpec] = []
    for spec in specs:
        if run and (spec.stack is None or spec.stack != run[0].stack):
            yield from _cut(run)
            run = []
        run.append(spec)
    if run:
        yield from _cut(run)


def _cut(run: list[TensorSpec]) -> Iterator[list[TensorSpec]]:
    step = max(1, SLAB_ELEMENTS // max(1, math.prod(run[0].shape)))
    for i in range(0, len(run), step):
        yield run[i : i + step]


def _owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with its own storage (safetensors refuses shared storage)."""
    return t.to("cpu", copy=True).contiguous()


class _Emitter:
    def __init__(self, sink: ShardedSafetensorsWriter | None, keep_values: bool) -> None:
        self.sink = sink
        self.keep_values = keep_values
        self.entries: dict[str, TensorEntry] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def _put(self, spec: TensorSpec, name: str, tensor: torch.Tensor, scale: bool) -> None:
        group = SCALE_GROUP.get(spec.group, spec.group) if scale else spec.group
        t = _owned_cpu(tensor)
        self.entries[name] = TensorEntry(
            name, t.dtype, tuple(t.shape), t.numel() * t.element_size(), group, spec.split
        )
        if self.sink is None:
            self.tensors[name] = t
        else:
            self.sink.put(name, t)

    def emit(self, chunk: Sequence[TensorSpec], stacked: torch.Tensor) -> None:
        spec = chunk[0]
        scales: torch.Tensor | None = None
        if spec.fmt is Format.FP8_BLOCK:
            stored, pow2 = quant_fp8_block(stacked)
            value = dequant_fp8_block(stored, pow2) if self.keep_values else None
            dtype = spec.scale_dtype or torch.float8_e8m0fnu
            scales = pow2_to_ue8m0(pow2) if dtype == torch.float8_e8m0fnu else pow2.to(dtype)
        elif spec.fmt is Format.MXFP4:
            packed, ue8m0 = quant_mxfp4_rows(stacked)
            value = dequant_mxfp4_rows(packed, ue8m0) if self.keep_values else None
            stored = packed.view(spec.packed_dtype)
            scales = ue8m0.view(spec.scale_dtype or torch.uint8)
        elif spec.fmt is Format.INDEX:
            stored = stacked.to(spec.dtype or torch.int32)
            value = stored
        else:
            stored = stacked if spec.dtype is None else stacked.to(spec.dtype)
            value = stored.float() if self.keep_values else None
        for i, s in enumerate(chunk):
            self._put(s, s.file_name, stored[i], scale=False)
            if scales is not None:
                self._put(s, str(s.scale_name), scales[i], scale=True)
            if value is not None:
                self.values[s.name] = _owned_cpu(value[i])


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """CPU writes are tiny tensors, where torch's thread pool costs more than it saves (10x on a
    busy 2-core machine); GPU work is unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _emit_specs(
    specs: Iterable[TensorSpec],
    draw: Draw,
    sink: ShardedSafetensorsWriter | None,
    keep_values: bool,
) -> _Emitter:
    emitter = _Emitter(sink, keep_values)
    with torch.no_grad(), _one_cpu_thread():
        for chunk in _slabs(specs):
            emitter.emit(chunk, draw(chunk))
    return emitter


def write_checkpoint(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    specs: Iterable[TensorSpec],
    draw: Draw,
    *,
    num_experts: int,
    keep_values: bool,
    max_shard_bytes: int | None = None,
) -> ReleaseCheckpoint:
    """Write ``config.json``, the shards and the index into ``path``."""
    root = Path(path)
    sink = ShardedSafetensorsWriter(root, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    emitter = _emit_specs(specs, draw, sink, keep_values)
    sink.close()
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ReleaseCheckpoint(
        path=root,
        config=MappingProxyType(copy.deepcopy(dict(config))),
        layout=CheckpointLayout.of(emitter.entries, num_experts),
        values=MappingProxyType(emitter.values) if keep_values else None,
    )


def in_memory(specs: Iterable[TensorSpec], draw: Draw, *, num_experts: int) -> ReleaseTensors:
    """The same tensors, kept in memory (for tests that load a name -> tensor mapping)."""
    emitter = _emit_specs(specs, draw, None, keep_values=True)
    return ReleaseTensors(
        tensors=MappingProxyType(emitter.tensors),
        layout=CheckpointLayout.of(emitter.entries, num_experts),
        values=MappingProxyType(emitter.values),
    )
