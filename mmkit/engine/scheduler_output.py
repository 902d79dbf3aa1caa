"""The immutable description of one engine step, from the scheduler to the model runner.

vLLM v1's split: the scheduler owns requests and their counters (`mmkit/engine/`); the
runner (`mmkit/worker/`) sees only these frozen records and keeps its own per-sequence
cache (`mmkit/worker/seq_state.py`), updated from them at the start of each step. The unit
is a sequence (a scheduler request's one token stream: n > 1 user requests arrive as n
requests), named by `seq_id`.

- `NewSeqData`: a sequence the runner has not seen (or must rebuild): everything it needs.
- `CachedSeqData`: a sequence the runner knows: new blocks and the computed-token count
  (the runner appends the tokens it samples itself).
- `finished_seq_ids`: sequences whose runner state can be dropped.
- `num_scheduled_tokens`: seq_id -> tokens to compute this step, in schedule order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
import torch

from mmkit.multimodal.items import ImageItem
from mmkit.sampling_params import SamplingParams


@dataclass(frozen=True)
class EncoderInput:
    """One item the runner encodes in this step and stores under `key`."""

    request_id: str
    key: str
    item: ImageItem | None  # a raw image: the processor builds its model inputs
    embeds: torch.Tensor | None  # or embeddings given by the user, [num_tokens, hidden]
    num_tokens: int  # rows expected (the item's placeholder range length)
    lora_request: Any = None  # the adapter the tower runs under (tower LoRA only)
    # The item's model inputs (vLLM's `mm_features`), attached by the engine from its input
    # stage after scheduling: the runner reads them here and never asks the stage itself.
    mm_kwargs: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class NewSeqData:
    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # prompt + tokens generated so far (a rebuild after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # of the sequence's generator (the runner keeps an existing one)
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    placeholder_ranges: tuple[tuple[int, int], ...] = ()
    encoder_keys: tuple[str, ...] = ()  # encoder-cache key of each item
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens] (a family declaring uses_mrope)
    mrope_position_delta: int = 0
    bidirectional_ranges: tuple[tuple[int, int], ...] = ()  # (offset, length) spans
    lora_request: Any = None  # mmkit.lora.LoRARequest or None
    state_slot: int = -1  # a hybrid decoder's per-request state slot (engine/state_cache_manager.py)


@dataclass(frozen=True)
class CachedSeqData:
    seq_id: int
    new_block_ids: tuple[int, ...]  # appended to its block table
    num_computed_tokens: int
    resumed: bool = False  # after preemption: `new_block_ids` is the whole table


@dataclass(frozen=True)
class SchedulerOutput:
    new_seqs: tuple[NewSeqData, ...] = ()
    cached_seqs: tuple[CachedSeqData, ...] = ()
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # in schedule order
    finished_seq_ids: frozenset[int] = frozenset()
    encoder_inputs: tuple[EncoderInput, ...] = ()  # to encode, in order
    free_encoder_keys: tuple[str, ...] = ()  # entries the runner drops (before encoding)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
