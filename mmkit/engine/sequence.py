"""Requests (`SequenceGroup`) and their sequences: the state the scheduler moves around."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mmkit.outputs import PositionLogprobs
from mmkit.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmkit.processors.base import ProcessedPrompt
    from mmkit.structured_outputs.request import StructuredOutputRequest


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


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt followed by its generated tokens."""

    group: "SequenceGroup"
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Grammar state of a constrained request (structured outputs); it has accepted every
    # output token, so a recompute after preemption (which keeps the tokens) leaves it valid.
    structured: "StructuredOutputRequest | None" = None
    # Detokenizer state (see mmkit/engine/detokenizer.py).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache key (SHA-256) of each full block
    # NOTE: the sampling pass that finishes the prompt of a request with n > 1 samples
    # produces all n first tokens; the other n - 1 sequences are forked from this one.
    num_pending_forks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def reset_for_recompute(self) -> None:
        """After preemption: the K/V is gone; every token is recomputed on resume."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (f"Sequence(req={self.group.request_id!r}, idx={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass(eq=False)
class SequenceGroup:
    """One request: a processed prompt, its sampling params and its n sequences."""

    request_id: str
    processed: "ProcessedPrompt"
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    # Samples 1..n-1 before the prompt is computed: they exist (with their generators) but
    # join `seqs` only when forked from seqs[0] after its prefill.
    pending_forks: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    image_hashes: list[str] | None = None  # content hash per image, computed on first use
    encoder_keys: list[str] | None = None  # encoder-cache key per item (set by the scheduler)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.processed.prompt_token_ids

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and not self.pending_forks

    def get_image_hashes(self) -> list[str]:
        if self.image_hashes is None:
            from mmkit.hashing import embeds_content_hash, image_content_hash

            if self.processed.image_embeds is not None:
                self.image_hashes = [embeds_content_hash(e) for e in self.processed.image_embeds]
            else:
                self.image_hashes = [image_content_hash(item) for item in self.processed.images]
        return self.image_hashes

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]
