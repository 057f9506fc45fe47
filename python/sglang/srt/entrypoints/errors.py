"""Error responses in OpenAI's shape, ``{"object": "error", "error": {"message", "type",
"param", "code"}}``, shared by the routes and the ASGI middleware (which answers before routing:
body too large, missing API key, an unexpected exception)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status_code: int = 400, param: str | None = None) -> dict[str, Any]:
    return {
        "object": "error",
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status_code, "Error"),
            "param": param,
            "code": status_code,
        },
    }


def error_response(message: str, status_code: int = 400, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status_code == 401 else None
    return JSONResponse(
        status_code=status_code, content=error_body(message, status_code, param), headers=headers
    )


def error_bytes(message: str, status_code: int = 400, param: str | None = None) -> bytes:
    return json.dumps(error_body(message, status_code, param), ensure_ascii=False).encode()
