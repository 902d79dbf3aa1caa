"""OpenAIError: a client error with its HTTP status, rendered as OpenAI's error body."""

from __future__ import annotations

import re
from http import HTTPStatus

from mmkit.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

# `messages[0].content[1]`, `stop[0]`, `top_p`: the request field an engine message names first.
_PARAM = re.compile(r"^\s*((?:inputs|messages|prompt)\[\d+\](?:[\w.\[\]]*)|[a-z_]+(?:\[\d+\]|\.[a-z_]+)*)\s*[:( ]")


class OpenAIError(Exception):
    """Raised by the serving code; the app turns it into `{"error": {...}}` with `status_code`."""

    def __init__(self, message: str, status_code: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _error_type(status_code)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def _error_type(status_code: int) -> str:
    if status_code == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def bad_request(exc: Exception, param: str | None = None) -> OpenAIError:
    """A `ValueError`/`TypeError` of mmkit's input checks as a 400; `param` from its message."""
    message = str(exc)
    if param is None:
        match = _PARAM.match(message)
        param = match.group(1) if match else None
    return OpenAIError(message, 400, param=param)
