"""The HTTP server's outer guard, a plain ASGI middleware in front of every route:

- ``--api-key``: every path but ``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise);
- ``--max-request-bytes``: a larger body is refused with 413, from its Content-Length header
  before anything is read, or as soon as the bytes received pass the limit;
- fault isolation: an exception no route handled becomes a JSON 500 naming it, for that request
  alone (Starlette's own answer is a plain-text 500 that also drops the keep-alive connection).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sglang.srt.entrypoints.errors import error_bytes
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})


class _BodyTooLarge(Exception):
    pass


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = error_bytes(message, status, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_key: str | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        needs_key = self.api_key is not None and scope.get("path") not in OPEN_PATHS
        if needs_key and not self._authorized(headers):
            await send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>' "
                "with the key the server was started with (--api-key)",
            )
            return
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await send_error(send, 400, f"invalid Content-Length header {declared!r}")
                return
            if size > limit:
                await send_error(send, 413, _too_large(limit, size))
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, 413, _too_large(limit, None))
        except Exception as exc:
            logger.exception(f"unhandled error serving {scope.get('method')} {scope.get('path')}")
            if not started:
                await send_error(send, 500, f"internal server error: {type(exc).__name__}: {exc}")


def _too_large(limit: int, size: int | None) -> str:
    got = f" ({size} bytes)" if size is not None else ""
    return (
        f"the request body is larger than the limit of {limit} bytes{got}; send less, or raise "
        "--max-request-bytes"
    )
