"""The error every request path raises for a request it will not (4xx) or could not (5xx) run."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server will not run (``status_code`` 4xx), or could not (5xx)."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
