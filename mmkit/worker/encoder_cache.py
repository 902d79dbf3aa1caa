"""The runner's encoder cache: item embeddings stored under the keys the scheduler names.

It decides nothing: the scheduler's `EncoderCacheManager` chooses what is encoded, what is
kept and what is dropped (`SchedulerOutput.encoder_inputs` / `free_encoder_keys`), so an
entry a step merges is always here. Kept across `generate` calls: ten questions about one
image run the vision tower once.
"""

from __future__ import annotations

import torch


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes  # the scheduler's bound (informational here)
        self.num_bytes = 0
        self._entries: dict[str, torch.Tensor] = {}  # key -> [num_tokens, hidden]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        return self._entries.get(key)

    def put(self, key: str, value: torch.Tensor) -> None:
        self.pop(key)
        self._entries[key] = value
        self.num_bytes += value.numel() * value.element_size()

    def pop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.numel() * old.element_size()
