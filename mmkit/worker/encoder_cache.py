"""Vision-embedding cache: projected image features keyed by image content hash, LRU,
bounded by a memory budget. Kept across `generate` calls, so a VQA run that asks ten
questions about one image runs the vision tower once."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if not self.enabled or size > self.budget_bytes or key in self._entries:
            return
        while self.num_bytes + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.num_bytes += size
