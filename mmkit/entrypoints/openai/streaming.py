"""Server-sent events and the per-choice bookkeeping of a stream."""

from __future__ import annotations

import json

from pydantic import BaseModel

from mmkit.entrypoints.openai.errors import OpenAIError
from mmkit.outputs import CompletionOutput


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


class StreamState:
    """What each choice has already sent: its text length, tokens, and whether it finished.

    `advance(c)` returns `(new_text, first_new_token, end_token)` when there is something to
    send (new text, or the finish), else None; a choice's finish is sent exactly once.
    """

    def __init__(self, n: int, prefixes: list[str] | None = None) -> None:
        self.sent_text = [0] * n
        self.sent_tokens = [0] * n
        self.done = [False] * n
        self.prefixes = prefixes or [""] * n  # text sent before the first delta (completions' echo)

    def advance(self, c: CompletionOutput, slot: int | None = None) -> tuple[str, int, int] | None:
        i = c.index if slot is None else slot
        if self.done[i]:
            return None
        finished = c.finish_reason is not None
        new_text = c.text[self.sent_text[i]:]
        if not new_text and not finished:
            return None
        prefix, self.prefixes[i] = self.prefixes[i], ""
        start, end = self.sent_tokens[i], len(c.token_ids)
        self.sent_text[i] = len(c.text)
        self.sent_tokens[i] = end
        self.done[i] = finished
        return prefix + new_text, start, end
