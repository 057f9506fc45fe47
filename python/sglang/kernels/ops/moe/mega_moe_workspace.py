"""The Triton MegaMoE kernel's int32 workspace: a tile queue and dependency counters that the
kernel leaves at zero when it ends, plus a sticky status word it sets when a wait gives up.

Layout (int32 words): ``[queue, exits, barrier, pad]`` then ``done1[num_m_blocks]`` (phase-1
tiles, or with FP8 quantised groups, finished per row block), with FP8
``groups[num_m_blocks * I/128]`` (phase-1 tiles finished per 128-wide activation group; the last
one quantises the group), then ``combined[tokens * n2_tiles]`` (expert rows written per token
and output column tile; the last writer combines and clears it). The last CTA to leave clears
the header and the ``done1``/``groups`` words.

Because every counter is cleared before the launch ends, one zeroing at allocation serves every
later launch (no memset per call, CUDA-graph friendly). A launch that timed out may leave
counters set, so the host clears the workspace when it reports the error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

HEADER_WORDS = 4
QUEUE, EXITS, BARRIER = 0, 1, 2

# Status codes written by the kernel (sticky until the host reads and clears them).
STATUS_OK = 0
STATUS_TILE_WAIT_TIMEOUT = 1
STATUS_GRID_BARRIER_TIMEOUT = 2


@dataclass(frozen=True)
class WorkspaceLayout:
    num_m_blocks: int
    num_tokens: int
    n2_tiles: int
    groups_per_block: int = 0  # FP8: 128-wide activation groups a row block quantises

    @property
    def groups(self) -> int:
        return HEADER_WORDS + self.num_m_blocks

    @property
    def done1(self) -> int:
        return HEADER_WORDS

    @property
    def combined(self) -> int:
        return self.groups + self.num_m_blocks * self.groups_per_block

    @property
    def words(self) -> int:
        return self.combined + self.num_tokens * self.n2_tiles


@dataclass
class Workspace:
    counters: torch.Tensor  # int32, zero between launches
    status: torch.Tensor  # int32 [1], sticky

    def clear(self) -> None:
        self.counters.zero_()
        self.status.zero_()


_workspaces: dict[tuple[int, int], Workspace] = {}
_lock = threading.Lock()


def get_workspace(device: torch.device, words: int) -> Workspace:
    """The zeroed workspace of ``device`` and the current stream, grown to ``words``.

    One per stream: two launches on different streams could overlap and must not share
    counters. Growing replaces the counters (zeroed) and keeps the status word."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.index if device.index is not None else -1, stream)
    with _lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = Workspace(
                torch.zeros(max(words, 1024), dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device),
            )
            _workspaces[key] = ws
        elif ws.counters.numel() < words:
            ws.counters = torch.zeros(
                max(words, 2 * ws.counters.numel()), dtype=torch.int32, device=device
            )
        return ws
