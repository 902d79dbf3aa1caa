"""Requests (`SequenceGroup`) and their token streams (`Sequence`): the scheduler's state.

vLLM v1's request model: one scheduler request is one sample. A user request with n > 1 is
fanned out by the engine at add time into n independent requests (`engine/parent_request.py`,
each with its own seed) and gathered again by the output processor, so nothing here forks.
The scheduler owns these objects (`Scheduler.requests`): token ids, computed-token counts,
status and prefix-cache keys (the block tables are the block manager's, keyed by `seq_id`).
The runner never sees them (it gets a `SchedulerOutput` and keeps its own per-sequence
cache); the output processor keeps the text, logprobs and metrics of each request
(`mmkit/engine/output_processor.py`).

Why two classes for one request: `SequenceGroup` holds what the request was given (processed
prompt, sampling params, item hashes and encoder keys), `Sequence` what the scheduler advances
(tokens, `num_computed_tokens`, status, block hashes), as vLLM v1's `Request` holds both.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmkit.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmkit.processors.base import ProcessedPrompt


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


_seq_counter = itertools.count()


class TokenCounts:
    """Counts over `token_ids` (the prompt, then the outputs), for the scheduler's `Sequence`
    and the output processor's per-sample state, which each keep their own list."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(eq=False)
class Sequence(TokenCounts):
    """One token stream: the prompt followed by its generated tokens."""

    group: "SequenceGroup"
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int = 0  # of the sampling generator the runner keeps for this sample
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache key (SHA-256) of each full block

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def num_tokens_whole_spans(self, start: int, num_new: int) -> int:
        """`num_new` adjusted so that the chunk [start, start + num_new) never ends inside a
        bidirectional span (its queries attend the span's later keys, which must be computed in
        the same chunk): it stops before the span, or, when it starts inside or at the span,
        runs to the span's end (past the token budget, as vLLM schedules such items whole)."""
        end = start + num_new
        for lo, length in self.group.processed.bidirectional_ranges:
            hi = lo + length
            if lo < end < hi:
                end = lo if lo > start else hi
                break
        return end - start

    def reset_for_recompute(self) -> None:
        """After preemption: the K/V is gone; every token is recomputed on resume."""
        self.num_computed_tokens = 0  # (the block manager has freed its blocks)
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (f"Sequence(req={self.group.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass(eq=False)
class SequenceGroup:
    """One scheduler request: a processed prompt, its sampling params (n = 1) and its sequence."""

    request_id: str
    processed: "ProcessedPrompt"
    params: SamplingParams
    seq: Sequence = field(init=False)
    image_hashes: list[str] | None = None  # content hash per image, computed on first use
    encoder_keys: list[str] | None = None  # encoder-cache key per item (set by the scheduler)

    @classmethod
    def create(cls, request_id: str, processed: "ProcessedPrompt", params: SamplingParams,
               seed: int) -> "SequenceGroup":
        """A request of one sample whose sampling generator starts from `seed`."""
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: a scheduler request has one sample; got n={params.n} "
                             f"(LLMEngine fans n > 1 out into child requests)")
        group = cls(request_id=request_id, processed=processed, params=params)
        group.seq = Sequence(group=group, token_ids=list(processed.prompt_token_ids),
                             num_prompt_tokens=len(processed.prompt_token_ids), seed=seed)
        return group

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.processed.prompt_token_ids

    @property
    def is_finished(self) -> bool:
        return self.seq.is_finished

    def get_image_hashes(self) -> list[str]:
        if self.image_hashes is None:
            from mmkit.multimodal.hashing import embeds_content_hash

            items, embeds = self.processed.images, self.processed.image_embeds
            if items:
                # Every item hashes itself, once (an image item; a video item adds its frames
                # and processor options; an item of given embeddings hashes them with its
                # layout); a prefetch worker has usually done it already.
                self.image_hashes = [item.content_hash() for item in items]
            else:  # given embeddings alone, a [N, tokens, hidden] tensor
                self.image_hashes = [embeds_content_hash(e) for e in embeds] if embeds is not None else []
        return self.image_hashes
