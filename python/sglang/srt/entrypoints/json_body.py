"""Parse a request body as JSON with limits: nesting depth, and valid Unicode in every string.

``json.loads`` recurses per nesting level, so ``[[[[...`` 100000 deep raised RecursionError (a
plain-text 500); and JSON escapes can carry a lone surrogate ("\\ud800") that no tokenizer or
encoder takes (a TypeError deep in the tokenizer). Both are the client's error: a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any


class JSONBodyError(ValueError):
    """The body is not JSON the server takes; the message says why."""


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The decoded body. Raises :class:`JSONBodyError`."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise JSONBodyError(
            f"the request body nests JSON deeper than the limit of {max_depth} levels "
            "(--max-json-depth)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JSONBodyError(f"the request body is not valid JSON: {exc}") from None
    check_json(data, max_depth)
    return data


def check_json(data: Any, max_depth: int) -> None:
    """Walk the document without recursion: depth and lone surrogates."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_str(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise JSONBodyError(
                f"the request body nests JSON deeper than the limit of {max_depth} levels "
                f"(--max-json-depth), at {path or 'the top level'}"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_str(key, f"a key in {path or 'the body'}")
                stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        else:
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):  # numbers need no check (long id lists)
                    stack.append((item, depth + 1, f"{path}[{i}]"))


def _check_str(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ascii(text[exc.start : exc.start + 1])
        where = path or "the body"
        raise JSONBodyError(
            f"{where} is not valid Unicode: lone surrogate {bad} at character {exc.start}"
        ) from None
