"""Incremental detokenization and stop-string matching.

Each step decodes only a short window: the text of the tokens already emitted last time
(the "prefix" window) and the same window plus the new tokens; the difference is the new
text. Decoding the prefix together with the new tokens keeps sentencepiece's leading
spaces and byte-level BPE's multi-byte characters right. A window that ends in an
incomplete character (U+FFFD) is held back until the next token completes it; at the end
the text is flushed from one full decode, so it always equals `tokenizer.decode(token_ids)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkit.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmkit.engine.output_processor import SeqOutputState as Sequence

_REPLACEMENT = "\ufffd"


def _decode(tokenizer, ids: list[int], params: SamplingParams) -> str:
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=params.spaces_between_special_tokens)


def decode_incrementally(tokenizer, seq: Sequence, params: SamplingParams) -> str:
    """Advance `seq.output_text` with the newly completed characters; return them."""
    # NOTE: slice the sequence's own list: only the short window is copied, never the whole
    # output (this runs for every generated token).
    ids, base = seq.token_ids, seq.num_prompt_tokens
    prefix_text = _decode(tokenizer, ids[base + seq.prefix_offset:base + seq.read_offset], params)
    new_text = _decode(tokenizer, ids[base + seq.prefix_offset:], params)
    if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(prefix_text):
        return ""  # incomplete character (or nothing visible yet): wait for more tokens
    if not new_text.startswith(prefix_text):
        # A merge changed earlier text (rare); fall back to a full decode for correctness.
        full = _decode(tokenizer, ids[base:], params)
        if full.startswith(seq.output_text):
            delta = full[len(seq.output_text):]
            seq.output_text = full
        else:
            delta = ""  # never rewrite streamed text; the final flush makes it exact
    else:
        delta = new_text[len(prefix_text):]
        seq.output_text += delta
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids) - base
    return delta


def flush(tokenizer, seq: Sequence, params: SamplingParams, drop_last: bool) -> None:
    """Final text from one full decode (`drop_last`: leave out a matched stop token)."""
    ids = seq.output_token_ids
    if drop_last:
        ids = ids[:-1]
    seq.output_text = _decode(tokenizer, ids, params)


def find_stop_string(seq: Sequence, params: SamplingParams, num_new_chars: int) -> bool:
    """Check the newest text for a stop string (it may span tokens); cut the text if found."""
    text = seq.output_text
    for stop in params.stop:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            end = idx + len(stop) if params.include_stop_str_in_output else idx
            seq.output_text = text[:end]
            seq.stop_reason = stop
            return True
    return False


def visible_text(seq: Sequence, params: SamplingParams, finished: bool) -> str:
    """While streaming, hold back a tail that might still become a stop string, so every
    streamed text is a prefix of the next one."""
    if finished or not params.stop or params.include_stop_str_in_output:
        return seq.output_text
    hold = max(len(s) for s in params.stop) - 1
    return seq.output_text[: max(0, len(seq.output_text) - hold)]
