"""The runner's own per-sequence cache, updated from each step's `SchedulerOutput`.

The runner never reads the scheduler's objects: a sequence arrives once as `NewSeqData`
(again after a preemption or a failed step), then as `CachedSeqData` (new blocks, computed
count); the tokens it samples it appends itself. Dropped when the sequence finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mmkit.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedSeqState:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + generated
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator
    block_table: list[int]
    num_computed_tokens: int
    placeholder_ranges: tuple[tuple[int, int], ...] = ()
    encoder_keys: tuple[str, ...] = ()
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens]
    mrope_position_delta: int = 0
    bidirectional_ranges: tuple[tuple[int, int], ...] = ()  # (offset, length) spans of the prompt
    lora_request: Any = None  # mmkit.lora.LoRARequest or None (the base model)
    state_slot: int = -1  # a hybrid decoder's state slot (worker/state_cache.py); -1: none
    # Per-sequence objects of sampler-side features (e.g. a grammar matcher), by feature name;
    # kept when the state is rebuilt (after a preemption or a failed step), dropped with it.
    sampler_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, end) of one sequence computed in this step."""

    state: CachedSeqState
    start: int
    end: int

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the end of the sequence (so a token is sampled)."""
        return self.end == len(self.state.token_ids)


class SamplerHook(Protocol):
    """A sampler-side feature in the runner (e.g. structured outputs): register it in
    `ModelRunner.sampler_hooks`. The runner calls, per step:

    - `on_new_seq(state)` when a sequence arrives for the first time (before its first
      output token); not called again on rebuilds, which keep `state.sampler_state`;
    - `apply(logits, states)` before sampling: logits [rows, vocab] float32, changed in place
      (e.g. a bitmask); `states[i]` owns row i;
    - `on_sampled(state, token_id)` after sampling, for the row each sequence keeps.
    """

    def on_new_seq(self, state: CachedSeqState) -> None: ...

    def apply(self, logits: torch.Tensor, states: list[CachedSeqState]) -> None: ...

    def on_sampled(self, state: CachedSeqState, token_id: int) -> None: ...
