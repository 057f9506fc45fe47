"""uvicorn's server with the engine's shutdown rules.

SIGTERM or SIGINT starts a drain: new requests get 503 and ``/health`` says so, requests in flight
run on for up to ``--shutdown-timeout`` seconds, then the rest are ended with an error (an error
event and ``[DONE]`` on a stream, a 503 otherwise) and the server stops; the process exits 0. A
second signal skips the wait. A scheduler rank that dies stops the server at once, exit code 1, so
a supervisor restarts it (it must never answer 503 forever).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn

from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_FLUSH_S = 2.0  # how long ended streams get to send their error event before connections close


class ServingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, grace_s: float) -> None:
        super().__init__(config)
        self.tm = tm
        self.grace_s = grace_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None
        tm.on_fatal = self.fatal

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler this records no signal to re-raise after serving: an
        # orderly shutdown exits 0, not 128 + the signal.
        name = signal.Signals(sig).name
        if self._loop is None or self.should_exit:
            self.should_exit = True
            return
        if self._draining:
            logger.warning(f"{name} again: ending the requests in flight now")
            self._loop.call_soon_threadsafe(self._end_now)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, name)

    def _start_drain(self, name: str) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(name))

    def _end_now(self) -> None:
        self.tm.fail_all("the server is shutting down (a second signal cut the grace period)", 503)
        self.grace_s = 0.0

    async def _drain(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        tm = self.tm
        tm.begin_drain()
        logger.info(
            f"{name}: shutting down; no new requests, waiting up to {self.grace_s:g}s for "
            f"{len(tm.states)} in flight (--shutdown-timeout; signal again to end them now)"
        )
        start = loop.time()
        while tm.states and loop.time() - start < self.grace_s:
            await asyncio.sleep(0.05)
        if tm.states:
            n = tm.fail_all(
                f"the server is shutting down; this request was ended after the grace period "
                f"of {self.grace_s:g}s (--shutdown-timeout)",
                503,
            )
            logger.warning(f"ended {n} request(s) still running after {self.grace_s:g}s")
            flush_start = loop.time()
            while tm.states and loop.time() - flush_start < _FLUSH_S:
                await asyncio.sleep(0.02)
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        """A scheduler rank died: stop serving, exit non-zero (event-loop thread)."""
        self.exit_code = 1
        self.should_exit = True
