"""DP-attention state: is_allocation_symmetric, safe pre-forward defaults, buffer allocation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.layers import dp_attention as dpa
from sglang.srt.layers.dp_attention import (
    DpPaddingMode,
    _DpGatheredBufferWrapper,
    is_allocation_symmetric,
    set_dp_attention_config,
    set_dp_buffer_len,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    set_dp_attention_config(False)
    _DpGatheredBufferWrapper.reset()
    yield
    set_dp_attention_config(False)
    _DpGatheredBufferWrapper.reset()


def test_defaults_readable_before_any_forward() -> None:
    """What a load-time prewarm may read before the first ForwardBatch exists."""
    set_dp_attention_config(True, dp_size=4)
    assert _DpGatheredBufferWrapper.get_global_dp_buffer_len() == 0
    assert _DpGatheredBufferWrapper.get_local_dp_buffer_len() == 0
    assert _DpGatheredBufferWrapper.get_global_num_tokens() is None
    assert dpa.get_dp_padding_mode() is DpPaddingMode.SUM_LEN
    assert dpa.is_dp_max_padding() is False
    # The conservative answer: never claim symmetry before a forward has said so.
    assert is_allocation_symmetric() is False


def test_wrapper_class_defaults_as_upstream_names_them() -> None:
    """The class-level names upstream code reads and tests patch, with their pre-forward values;
    ``_dp_max_padding`` is the state every padding query answers from."""
    w = _DpGatheredBufferWrapper
    assert (w._global_dp_buffer_len, w._local_dp_buffer_len) == (0, 0)
    assert w._dp_max_padding is False and w._global_num_tokens is None
    set_dp_attention_config(True, dp_size=2)
    set_dp_buffer_len(8, 8, DpPaddingMode.MAX_LEN, [8, 8])
    assert w._dp_max_padding is True and w._global_num_tokens == (8, 8)
    assert dpa.is_dp_max_padding() and is_allocation_symmetric()
    w._dp_max_padding = False  # what a test patching the class sees through the module API
    assert not dpa.is_dp_max_padding() and not is_allocation_symmetric()
    assert dpa.get_dp_padding_mode() is DpPaddingMode.SUM_LEN


def test_defaults_with_dp_attention_off() -> None:
    assert not dpa.is_dp_attention_enabled()
    assert is_allocation_symmetric() is True


@pytest.mark.parametrize(
    ("dp_enabled", "mode", "symmetric"),
    [
        (False, None, True),
        (False, DpPaddingMode.MAX_LEN, True),
        (False, DpPaddingMode.SUM_LEN, True),
        (True, None, False),  # before the first forward
        (True, DpPaddingMode.MAX_LEN, True),
        (True, DpPaddingMode.SUM_LEN, False),
    ],
)
def test_is_allocation_symmetric_truth_table(
    dp_enabled: bool, mode: DpPaddingMode | None, symmetric: bool
) -> None:
    set_dp_attention_config(dp_enabled, dp_size=2 if dp_enabled else 1)
    if mode is not None:
        set_dp_buffer_len(16, 8 if mode.is_sum_len() else 16, mode)
    assert is_allocation_symmetric() is symmetric


def test_mode_follows_each_forward() -> None:
    set_dp_attention_config(True, dp_size=2)
    set_dp_buffer_len(32, 16, DpPaddingMode.MAX_LEN, [16, 16])
    assert is_allocation_symmetric()
    assert _DpGatheredBufferWrapper.get_global_num_tokens() == (16, 16)
    set_dp_buffer_len(20, 7, DpPaddingMode.SUM_LEN, [7, 13])
    assert not is_allocation_symmetric()
    assert _DpGatheredBufferWrapper.get_global_dp_buffer_len() == 20
    assert _DpGatheredBufferWrapper.get_local_dp_buffer_len() == 7


def test_set_dp_buffer_len_validates() -> None:
    with pytest.raises(ValueError):
        set_dp_buffer_len(-1, 0, DpPaddingMode.MAX_LEN)
    with pytest.raises(ValueError, match="exceeds"):
        set_dp_buffer_len(4, 8, DpPaddingMode.MAX_LEN)
    with pytest.raises(TypeError):
        set_dp_buffer_len(4, 2, "max_len")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        set_dp_attention_config(True, dp_size=0)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, bool]] = []

    @contextmanager
    def __call__(self, group: Any, disabled: bool = False) -> Iterator[None]:
        self.calls.append((group, disabled))
        yield


@pytest.mark.parametrize(
    ("dp_enabled", "mode", "disabled"),
    [
        (False, DpPaddingMode.SUM_LEN, False),
        (True, DpPaddingMode.MAX_LEN, False),
        (True, DpPaddingMode.SUM_LEN, True),
    ],
)
def test_buffers_allocate_under_symmetric_memory(
    monkeypatch: pytest.MonkeyPatch, dp_enabled: bool, mode: DpPaddingMode, disabled: bool
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(output_scope, "use_symmetric_memory", recorder)
    set_dp_attention_config(dp_enabled, dp_size=2)
    _DpGatheredBufferWrapper.set_metadata(8, torch.bfloat16, "cpu")
    set_dp_buffer_len(6, 3 if mode.is_sum_len() else 6, mode)
    g = dpa.get_dp_global_buffer()
    loc = dpa.get_dp_local_buffer()
    assert g.shape == (6, 8) and g.dtype == torch.bfloat16
    assert loc.shape == ((3, 8) if mode.is_sum_len() else (6, 8))
    assert recorder.calls == [(None, disabled), (None, disabled)], "no TP group outside a server"


def test_buffer_without_metadata_names_the_fix() -> None:
    set_dp_buffer_len(4, 4, DpPaddingMode.MAX_LEN)
    with pytest.raises(RuntimeError, match="set_metadata"):
        dpa.get_dp_global_buffer()
    buf = dpa.get_dp_global_buffer(hidden_size=2, dtype=torch.float32, device="cpu")
    assert buf.shape == (4, 2)


if __name__ == "__main__":
    run_this_file(__file__)
