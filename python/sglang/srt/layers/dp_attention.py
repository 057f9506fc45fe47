"""DP-attention state the rest of the engine reads: is it on, how this batch is padded, and
whether allocations are the same on every rank (the precondition of the symmetric pool).

With DP attention each rank attends over its own requests and the MLP/MoE runs on tokens
gathered from all ranks. Per batch, the gather uses one of two paddings (same choice on all
ranks, computed from the all-gathered token counts):

* ``MAX_LEN``: every rank pads to the largest count, so every rank allocates the same shapes;
* ``SUM_LEN``: each rank keeps its own count, so local shapes differ across ranks.

Only under ``MAX_LEN`` (or with DP attention off) may an allocation go to the NCCL symmetric
pool, whose registration is collective and needs identical allocations on all ranks.

The hook the MoE side calls around a block that spans every rank (both per step, on every rank,
after :func:`set_dp_state_for_step` has run from the step's plan):

* :func:`dp_gather` ``(local [n_g, ...]) -> gathered [global_len, ...]``: every DP group's tokens,
  in group order (``MAX_LEN``: group ``g`` at rows ``g * max``, padding rows zero; ``SUM_LEN``:
  packed). One all-gather over the TP group, to which each attention-TP rank of a group sends its
  share of the group's rows (each group's tokens travel once).
* :func:`dp_scatter` ``(gathered) -> local``: this group's rows back (a slice, no collective;
  the MoE output is complete on every rank after its own all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from sglang.srt.distributed.parallel_state import (
    get_attention_dp_rank,
    get_attn_tp_group,
    get_tp_group,
)

# The symmetric-pool rule is symm_mem's (this module answers its "same allocations on every
# rank?"); its names stay importable from here, where upstream SGLang has them.
from sglang.srt.distributed.symm_mem.output_scope import (  # noqa: F401  (re-exported)
    is_allocation_symmetric,
    set_allocation_symmetry,
    symmetric_output_scope,
)
from sglang.srt.layers.build_spec import LayerBuildSpec


class DpPaddingMode(Enum):
    MAX_LEN = "max_len"
    SUM_LEN = "sum_len"

    def is_max_len(self) -> bool:
        return self is DpPaddingMode.MAX_LEN

    def is_sum_len(self) -> bool:
        return self is DpPaddingMode.SUM_LEN


@dataclass(frozen=True)
class DpAttentionConfig:
    enabled: bool = False
    dp_size: int = 1
    attn_tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.attn_tp_size < 1:
            raise ValueError(f"dp_size and attn_tp_size must be >= 1, got {self}")


_config = DpAttentionConfig()


def set_dp_attention_config(enabled: bool, dp_size: int = 1, attn_tp_size: int = 1) -> None:
    """Record the server's DP-attention setting (once, at start-up)."""
    global _config
    _config = DpAttentionConfig(enabled=enabled, dp_size=dp_size, attn_tp_size=attn_tp_size)


def get_dp_attention_config() -> DpAttentionConfig:
    return _config


def is_dp_attention_enabled() -> bool:
    return _config.enabled


def attention_tp(tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The (rank, size) a model builds its attention with: within the attention-TP group under
    DP attention (consecutive ranks form a group), the TP rank and size otherwise."""
    if not _config.enabled:
        return tp_rank, tp_size
    attn = _config.attn_tp_size
    if attn * _config.dp_size != tp_size:
        raise ValueError(
            f"DP attention is set up for {_config.dp_size} groups of {attn} ranks, but the model "
            f"is built for TP size {tp_size}"
        )
    return tp_rank % attn, attn


def attention_spec(spec: LayerBuildSpec) -> LayerBuildSpec:
    """``spec`` for a model's attention layers: its place in the attention-TP group, whose
    row-parallel layers then all-reduce over that group (and whose loaders take that group's
    slice of the checkpoint); ``spec`` itself with DP attention off."""
    if not _config.enabled:
        return spec
    return spec.with_tp(*attention_tp(spec.tp_rank, spec.tp_size), tp_group="attn_tp")


class _DpGatheredBufferWrapper:
    """Per-forward sizes of the DP gathered buffers, as class-level state.

    Every attribute has a real default, so code that runs before the first forward (load-time
    prewarm, kernel JIT) can read it. The default padding mode is ``SUM_LEN`` on purpose: with
    DP attention on it makes :func:`is_allocation_symmetric` answer False until a forward says
    otherwise, and a wrong False only sends allocations to the default allocator (correct,
    slower), whereas a wrong True could start a one-sided collective registration (a hang).

    Private as in upstream SGLang: the module functions below are the interface; the class keeps
    the names (``_global_dp_buffer_len``, ``_local_dp_buffer_len``, ``_dp_max_padding``,
    ``_global_num_tokens``) that upstream code and users patch in tests."""

    _hidden_size: int | None = None
    _dtype: torch.dtype | None = None
    _device: torch.device | None = None
    _global_dp_buffer_len: int = 0
    _local_dp_buffer_len: int = 0
    _dp_max_padding: bool = False  # this batch padded to MAX_LEN (else SUM_LEN)
    _global_num_tokens: tuple[int, ...] | None = None

    @classmethod
    def set_metadata(cls, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Shape facts fixed at model init."""
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        cls._hidden_size = hidden_size
        cls._dtype = dtype
        cls._device = torch.device(device)

    @classmethod
    def set_dp_buffer_len(
        cls,
        global_len: int,
        local_len: int,
        padding_mode: DpPaddingMode,
        global_num_tokens: list[int] | tuple[int, ...] | None = None,
    ) -> None:
        """Called once per forward, before the model runs, with the same ``padding_mode`` on
        every rank."""
        if global_len < 0 or local_len < 0:
            raise ValueError(f"buffer lengths must be >= 0, got {global_len}, {local_len}")
        if local_len > global_len:
            raise ValueError(f"local length {local_len} exceeds global length {global_len}")
        if not isinstance(padding_mode, DpPaddingMode):
            raise TypeError(f"padding_mode must be a DpPaddingMode, got {padding_mode!r}")
        cls._global_dp_buffer_len = global_len
        cls._local_dp_buffer_len = local_len
        cls._dp_max_padding = padding_mode.is_max_len()
        cls._global_num_tokens = tuple(global_num_tokens) if global_num_tokens is not None else None

    @classmethod
    def reset(cls) -> None:
        """Back to the pre-forward defaults (tests, model teardown)."""
        cls._hidden_size = None
        cls._dtype = None
        cls._device = None
        cls._global_dp_buffer_len = 0
        cls._local_dp_buffer_len = 0
        cls._dp_max_padding = False
        cls._global_num_tokens = None

    @classmethod
    def get_padding_mode(cls) -> DpPaddingMode:
        return DpPaddingMode.MAX_LEN if cls._dp_max_padding else DpPaddingMode.SUM_LEN

    @classmethod
    def is_dp_max_padding(cls) -> bool:
        return cls._dp_max_padding

    @classmethod
    def get_global_dp_buffer_len(cls) -> int:
        return cls._global_dp_buffer_len

    @classmethod
    def get_local_dp_buffer_len(cls) -> int:
        return cls._local_dp_buffer_len

    @classmethod
    def get_global_num_tokens(cls) -> tuple[int, ...] | None:
        return cls._global_num_tokens

    @classmethod
    def _allocate(
        cls,
        length: int,
        hidden_size: int | None,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> torch.Tensor:
        hidden_size = hidden_size if hidden_size is not None else cls._hidden_size
        dtype = dtype if dtype is not None else cls._dtype
        device = device if device is not None else cls._device
        if hidden_size is None or dtype is None or device is None:
            raise RuntimeError(
                "DP gathered buffer metadata is not set: call "
                "_DpGatheredBufferWrapper.set_metadata(hidden_size, dtype, device) at model init"
            )
        with symmetric_output_scope():
            return torch.empty((length, hidden_size), dtype=dtype, device=device)

    @classmethod
    def get_global_dp_buffer(
        cls,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """A fresh ``(global_len, hidden)`` buffer for the gathered tokens (symmetric pool when
        allocation is symmetric)."""
        return cls._allocate(cls._global_dp_buffer_len, hidden_size, dtype, device)

    @classmethod
    def get_local_dp_buffer(
        cls,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        return cls._allocate(cls._local_dp_buffer_len, hidden_size, dtype, device)


def get_dp_padding_mode() -> DpPaddingMode:
    return _DpGatheredBufferWrapper.get_padding_mode()


def is_dp_max_padding() -> bool:
    return _DpGatheredBufferWrapper.is_dp_max_padding()


def same_allocations_on_every_rank() -> bool:
    """Whether every rank makes the same allocations now: DP attention off, or this batch is
    padded to ``MAX_LEN``; the symmetric pool's rule (``symm_mem.output_scope``) asks this."""
    return not is_dp_attention_enabled() or is_dp_max_padding()


set_allocation_symmetry(same_allocations_on_every_rank)


def set_dp_buffer_len(
    global_len: int,
    local_len: int,
    padding_mode: DpPaddingMode,
    global_num_tokens: list[int] | tuple[int, ...] | None = None,
) -> None:
    _DpGatheredBufferWrapper.set_dp_buffer_len(
        global_len, local_len, padding_mode, global_num_tokens
    )


def get_dp_global_buffer(
    hidden_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    return _DpGatheredBufferWrapper.get_global_dp_buffer(hidden_size, dtype, device)


def get_dp_local_buffer(
    hidden_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    return _DpGatheredBufferWrapper.get_local_dp_buffer(hidden_size, dtype, device)


# --- per step, from the plan ----------------------------------------------------------------


def choose_dp_padding(num_tokens: tuple[int, ...] | list[int]) -> DpPaddingMode:
    """Rank 0's choice for a step, from every DP group's token count: ``MAX_LEN`` (symmetric
    allocations, the pool usable) when padding every group to the largest adds at most half
    again the real rows (decode steps, balanced prefills), else ``SUM_LEN`` (an idle group, or
    one long prefill beside short decodes)."""
    if not num_tokens:
        return DpPaddingMode.SUM_LEN
    padded, total = max(num_tokens) * len(num_tokens), sum(num_tokens)
    return DpPaddingMode.MAX_LEN if 2 * padded <= 3 * total else DpPaddingMode.SUM_LEN


def set_dp_state_for_step(
    num_tokens: tuple[int, ...], padding: DpPaddingMode, dp_rank: int
) -> None:
    """Every rank, before its forward: the gathered and local lengths of this step."""
    if not num_tokens:
        raise ValueError("a DP step needs every group's token count")
    if not 0 <= dp_rank < len(num_tokens):
        raise ValueError(f"DP rank {dp_rank} outside {len(num_tokens)} groups")
    if padding.is_max_len():
        global_len = max(num_tokens) * len(num_tokens)
    else:
        global_len = sum(num_tokens)
    set_dp_buffer_len(global_len, num_tokens[dp_rank], padding, num_tokens)


def set_dp_state_for_warmup(num_tokens: int) -> None:
    """Every rank runs the same warm-up forward: each DP group has ``num_tokens`` rows. No-op
    with DP attention off."""
    if is_dp_attention_enabled():
        counts = (num_tokens,) * _config.dp_size
        set_dp_state_for_step(counts, DpPaddingMode.MAX_LEN, get_attention_dp_rank())


def reset_dp_state() -> None:
    """Back to the pre-forward lengths and ``SUM_LEN`` (the safe default), metadata kept."""
    set_dp_buffer_len(0, 0, DpPaddingMode.SUM_LEN, None)


def _group_offset(num_tokens: tuple[int, ...], dp_rank: int) -> int:
    if is_dp_max_padding():
        return dp_rank * max(num_tokens)
    return sum(num_tokens[:dp_rank])


def _step_tokens() -> tuple[int, ...]:
    counts = _DpGatheredBufferWrapper.get_global_num_tokens()
    if counts is None:
        raise RuntimeError(
            "dp_gather/dp_scatter before the step's DP state is set (set_dp_state_for_step)"
        )
    return counts


def dp_gather(local: torch.Tensor) -> torch.Tensor:
    """This DP group's rows ``[n_g, ...]`` -> all groups' rows ``[global_len, ...]`` on every rank
    (see the module docstring for the layout). The identity with DP attention off. The result is
    allocated in :func:`symmetric_output_scope` (the pool only under ``MAX_LEN``)."""
    if not is_dp_attention_enabled():
        return local
    counts = _step_tokens()
    dp_rank = get_attention_dp_rank()
    if local.shape[0] != counts[dp_rank]:
        raise ValueError(
            f"DP group {dp_rank} has {local.shape[0]} rows but the step planned {counts[dp_rank]}"
        )
    attn = get_attn_tp_group()
    # The ranks of one group hold the same rows (attention ends in its all-reduce), so each sends
    # only its 1/attn-TP share of them: every group's rows cross the wire once, not once a rank.
    chunk = -(-max(counts) // attn.world_size)
    padded = local.new_zeros((chunk * attn.world_size, *local.shape[1:]))
    padded[: local.shape[0]] = local
    share = padded[attn.rank_in_group * chunk : (attn.rank_in_group + 1) * chunk]
    # TP rank order is (group, attention-TP rank): the shares concatenate into each group's rows.
    every = get_tp_group().all_gather(share, dim=0)
    rows = every.view(len(counts), chunk * attn.world_size, *local.shape[1:])
    biggest = max(counts)
    with symmetric_output_scope():
        out = torch.empty(
            (_DpGatheredBufferWrapper.get_global_dp_buffer_len(), *local.shape[1:]),
            dtype=local.dtype,
            device=local.device,
        )
    if is_dp_max_padding():
        out.copy_(rows[:, :biggest].reshape(out.shape))
    else:
        torch.cat([rows[g, :n] for g, n in enumerate(counts)], out=out)
    return out


def dp_scatter(gathered: torch.Tensor) -> torch.Tensor:
    """All groups' rows -> this group's rows (a view of ``gathered``). The identity with DP
    attention off."""
    if not is_dp_attention_enabled():
        return gathered
    counts = _step_tokens()
    dp_rank = get_attention_dp_rank()
    start = _group_offset(counts, dp_rank)
    return gathered[start : start + counts[dp_rank]]
