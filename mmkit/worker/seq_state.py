"""The runner's own per-sequence cache, updated from each step's `SchedulerOutput`.

The runner never reads the scheduler's objects: a sequence arrives once as `NewSeqData`
(again after a preemption or a failed step), then as `CachedSeqData` (new blocks, computed
count); the tokens it samples it appends itself. Dropped when the sequence finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmkit.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedSeqState:
    seq_id: int
    request_id: str
    sample_index: int
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
    pending_forks: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, seed)

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
