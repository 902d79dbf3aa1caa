"""Exceptions that are part of mmkit's public contract."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The AsyncLLMEngine's background loop failed; every waiting caller gets this.

    The engine stays dead until it is rebuilt.
    """


class RequestError(RuntimeError):
    """A failure that belongs to specific requests (say, an image that cannot be processed),
    raised from an engine step; `__cause__` is the original exception. The engine aborts those
    requests alone and keeps serving the others."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
