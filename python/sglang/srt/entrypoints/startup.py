"""``start_engine(args)``: the startup the offline :class:`Engine` and the HTTP server share.

Resolve and validate the options, load the tokenizer (a missing one fails in milliseconds, before
any model loads), start the scheduler ranks, and put a tokenizer manager in front of them. The
caller binds the manager to its event loop (``tm.start(loop)``) and, at the end, calls
:meth:`StartedEngine.shutdown`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang.srt.managers.launcher import SchedulerHandle, launch_schedulers, resolve_model_path
from sglang.srt.managers.tokenizer_manager import TokenizerManager, load_server_tokenizer
from sglang.srt.server_args import ServerArgs, ServerArgsError


@dataclass(frozen=True)
class StartedEngine:
    server_args: ServerArgs  # resolved, validated, with the model path filled in
    handle: SchedulerHandle
    tokenizer_manager: TokenizerManager

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop sending, then stop the scheduler ranks (waiting up to ``timeout_s`` for them)."""
        self.tokenizer_manager.close()
        self.handle.shutdown(timeout_s=timeout_s)


def start_engine(
    args: ServerArgs, preflight: Callable[[ServerArgs], None] | None = None
) -> StartedEngine:
    """Start the engine for ``args`` as given (resolved and validated here: a bad combination or a
    bad SGLANG_* value raises :class:`ServerArgsError` before anything starts). ``preflight``
    runs on the validated options before anything loads (the server checks its port there)."""
    args = args.resolved()
    args.validate()
    if args.node_rank > 0:
        raise ServerArgsError(
            f"--node-rank {args.node_rank}: only node 0 runs the engine's front end (HTTP or "
            "Engine); start the other nodes with python -m sglang.launch_server and the same flags"
        )
    if preflight is not None:
        preflight(args)
    args = resolve_model_path(args)
    tokenizer = load_server_tokenizer(args)
    handle = launch_schedulers(args)
    try:
        tm = TokenizerManager(args, handle, tokenizer)
    except BaseException:
        handle.shutdown()  # do not leave the ranks running behind a failed start
        raise
    return StartedEngine(args, handle, tm)
