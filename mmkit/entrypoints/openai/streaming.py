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
    """What each choice has already sent: its text, its tokens, and whether it finished.

    `advance(c)` returns `(new_text, first_new_token, end_token)` when there is something to
    send (new text, or the finish), else None; a choice's finish is sent exactly once.
    """

    def __init__(self, n: int, prefixes: list[str] | None = None) -> None:
        self.sent_text = [""] * n
        self.sent_tokens = [0] * n
        self.done = [False] * n
        self.prefixes = prefixes or [""] * n  # text sent before the first delta (completions' echo)

    def advance(self, c: CompletionOutput, slot: int | None = None) -> tuple[str, int, int] | None:
        i = c.index if slot is None else slot
        if self.done[i]:
            return None
        finished = c.finish_reason is not None
        sent = self.sent_text[i]
        # NOTE: the engine never rewrites text it has shown; if it ever did, a stream cannot
        # take text back: nothing more is sent for this choice but its finish.
        new_text = c.text[len(sent):] if c.text.startswith(sent) else ""
        if not new_text and not finished:
            return None
        prefix, self.prefixes[i] = self.prefixes[i], ""
        start, end = self.sent_tokens[i], len(c.token_ids)
        if new_text:
            self.sent_text[i] = sent + new_text
        self.sent_tokens[i] = end
        self.done[i] = finished
        return prefix + new_text, start, end
