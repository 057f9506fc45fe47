"""What the executor needs of a model, declared: every served model is a :class:`ServedModel`;
request caches in slots of a preallocated, paged pool (decoded eagerly or by the static decode)
the optional :class:`SupportsSlotPool`, the static decode (the CUDA-graph body over that pool)
the optional :class:`SupportsStaticDecode` (which a model may keep closed behind
:class:`GatedStaticDecode`), and what its caches and workspace cost (the default
``--max-total-tokens``) the optional :class:`SupportsMemoryModel`, and how its caches store
their rows (``--kv-cache-dtype``) the optional :class:`SupportsKVCacheDtype`.

Models implement these structurally (no import of this file). The executor checks them with
``isinstance`` and, where an ability is required, :func:`require_ability` names what is missing,
instead of probing attributes one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch

from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.moe_runner import MoERunner
from sglang.srt.mem_cache.block_pool import BlockPool
from sglang.srt.mem_cache.kv_cache_dtype import KVLayout
from sglang.srt.mem_cache.memory_models.memory_model import MemoryModel

# One static decode step: (input_ids, positions, slots) [bs] -> logits [bs, V].
StaticStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ServedModelConfig(Protocol):
    vocab_size: int
    max_position_embeddings: int


class SlotPool(Protocol):
    scratch_slot: int
    block_pool: BlockPool  # the paged state's blocks (the scheduler admits by them)

    def nbytes(self) -> int: ...


@runtime_checkable
class ServedModel(Protocol):
    """The batch API every served model has (see ``models/registry.py``), and its MoE layers."""

    @property
    def config(self) -> ServedModelConfig: ...

    def new_request_cache(self) -> object: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: object,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of every row, or of ``logit_rows`` (an int64 index) only."""
        ...

    def moe_layers(self) -> Iterator[FusedMoE]:
        """The model's routed-expert layers (the declared way to reach their runners)."""
        ...


@runtime_checkable
class SupportsSlotPool(Protocol):
    """Request caches in slots of a preallocated pool: fixed-size state by slot, growing state in
    the blocks the slots share; the eager forward reads and writes them in place."""

    @property
    def slot_pool(self) -> SlotPool | None: ...

    def enable_slot_pool(
        self,
        max_slots: int,
        capacity: int,
        *,
        num_blocks: int | None = None,
        block_tokens: int | None = None,
        total_tokens: int | None = None,
    ) -> SlotPool: ...

    def new_pooled_cache(self) -> object: ...

    def free_pooled_cache(self, cache: object) -> None: ...


@runtime_checkable
class SupportsStaticDecode(SupportsSlotPool, Protocol):
    """One decode token per pooled request with fixed shapes and no host sync (the body of a
    decode CUDA graph), and the eager decode through it."""

    def static_decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor: ...

    def decode_pooled(
        self,
        input_ids: torch.Tensor,
        caches: Sequence[object],
        *,
        pad_to: int | None = None,
        step: StaticStep | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class SupportsMemoryModel(Protocol):
    """What a cached token, a running request and a step's workspace cost this rank
    (``mem_cache/memory_models/``): the default ``--max-total-tokens`` is then a bound measured
    from GPU memory, which the slot pool may preallocate. Without one it is
    the worst case (context x max running requests)."""

    def memory_model(self) -> MemoryModel: ...


@runtime_checkable
class SupportsKVCacheDtype(Protocol):
    """Caches whose rows follow ``--kv-cache-dtype`` (the layout the model resolved it to);
    a model without it keeps every cache in the model dtype."""

    @property
    def kv_layout(self) -> KVLayout: ...


@runtime_checkable
class GatedStaticDecode(Protocol):
    """A static decode the model can turn off (Kimi K3's, behind ``SGLANG_K3_STATIC_DECODE``, on by
    default): the executor decodes such a model eagerly while the gate gives a reason."""

    def static_decode_gate_reason(self) -> str | None: ...


def static_decode_reason(model: object) -> str | None:
    """Why the executor must not decode ``model`` through its static decode (None: it may): it
    has none, or its gate is closed."""
    if not isinstance(model, SupportsStaticDecode):
        return f"{type(model).__name__} has no static decode; decode runs eagerly"
    if isinstance(model, GatedStaticDecode):
        return model.static_decode_gate_reason()
    return None


AbilityT = TypeVar("AbilityT")


def missing_ability_reason(model: object, ability: type) -> str | None:
    """Why ``model`` is not an ``ability`` (None: it is): the members it lacks, by name."""
    if isinstance(model, ability):
        return None
    missing = [m for m in sorted(_protocol_members(ability)) if not hasattr(model, m)]
    return (
        f"{type(model).__name__} does not implement {ability.__name__} "
        f"(missing: {', '.join(missing)})"
    )


def require_ability(model: object, ability: type[AbilityT]) -> AbilityT:
    """``model`` as an ``ability``, or a TypeError naming the ability and what is missing."""
    why = missing_ability_reason(model, ability)
    if why is not None:
        raise TypeError(why)
    return model  # type: ignore[return-value]


def _protocol_members(ability: type) -> set[str]:
    """The public members a Protocol and its Protocol bases declare."""
    names: set[str] = set()
    for base in ability.__mro__:
        if base is object or base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        names |= {n for n in vars(base) if not n.startswith("_")}
        names |= set(getattr(base, "__annotations__", {}))
    return names


# The optional abilities, in the order the startup log names them.
ABILITIES: tuple[type, ...] = (
    SupportsSlotPool,
    SupportsStaticDecode,
    GatedStaticDecode,
    SupportsMemoryModel,
    SupportsKVCacheDtype,
)


def abilities_of(model: object) -> list[str]:
    """The optional abilities a built model implements beyond the batch API, by Protocol name
    (the startup log names them)."""
    return [ability.__name__ for ability in ABILITIES if isinstance(model, ability)]


def moe_runners(model: ServedModel) -> Iterator[MoERunner]:
    """The runner of every MoE layer of ``model``, through its declared ``moe_layers()``."""
    for layer in model.moe_layers():
        yield layer.runner
