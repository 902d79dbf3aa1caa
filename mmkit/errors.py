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


class RequestFailedError(RuntimeError):
    """Some prompts of one `LLM.generate` (or `LLM.chat`) call failed after they were admitted
    (say, an image that cannot be decoded); every other prompt ran to completion.

    `outputs`: the call's `RequestOutput`s in input order, `None` for each failed prompt
    (nothing computed is lost). `failed`: input index -> the exception of that prompt.
    `request_ids`: input index -> request id of each failed prompt. `__cause__` is the
    first failure."""

    def __init__(self, outputs: list, failed: dict[int, BaseException], request_ids: dict[int, str]) -> None:
        self.outputs = list(outputs)
        self.failed = dict(failed)
        self.request_ids = dict(request_ids)
        parts = [f"inputs[{i}] (request {request_ids[i]!r}): {type(e).__name__}: {e}" for i, e in sorted(failed.items())]
        super().__init__(
            f"{len(failed)} of {len(outputs)} prompts failed: " + "; ".join(parts)
            + ". The other prompts completed: their outputs are in this error's .outputs (None for each failed prompt)")


def error_message(exc: BaseException) -> str:
    """How a per-item caller (eval records, Ray rows) writes an item's error: a bad input's own
    message (`ValueError`/`TypeError` name the field and the cause), anything else with its type."""
    if isinstance(exc, (ValueError, TypeError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
