"""Logging helpers: one logger per module, and lines that are worth saying only once."""

from __future__ import annotations

import logging
import threading

_configured = False
_once_lock = threading.Lock()
_said: set[tuple[str, str]] = set()


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("sglang")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
            root.setLevel(logging.INFO)
        _configured = True
    return logging.getLogger(name)


def log_once(logger: logging.Logger, level: int, message: str) -> bool:
    """Log ``message`` the first time this logger sees it; returns whether it was logged."""
    key = (logger.name, message)
    if key in _said:  # hot-path callers: no lock once it was said
        return False
    with _once_lock:
        if key in _said:
            return False
        _said.add(key)
    logger.log(level, message)
    return True


_paths_said: set[tuple[str, bool]] = set()


def log_path_once(logger: logging.Logger, what: str, reason: str | None) -> None:
    """Say which path ``what`` takes the first time it takes it: its Triton kernel (``reason``
    None) or the torch path, with the first reason seen (a hot-path call: one set lookup once
    both were said)."""
    key = (what, reason is None)
    if key in _paths_said:
        return
    with _once_lock:
        if key in _paths_said:
            return
        _paths_said.add(key)
    if reason is None:
        logger.info(f"{what}: Triton kernel")
    else:
        logger.info(f"{what}: torch path ({reason})")
