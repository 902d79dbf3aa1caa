"""EncoderCacheManager: the scheduler's book of which item embeddings the runner holds.

vLLM v1's split: the scheduler decides what is encoded and what is dropped; the runner
only stores tensors under the keys the scheduler names (`mmkit/worker/encoder_cache.py`).
An entry is referenced by every scheduled sequence whose current chunks still need it and
is never evicted while referenced, so no step can evict what it is about to merge. An
entry nobody references stays cached (LRU) for later requests with the same image until
its space is needed; the keys evicted are handed to the runner in the next
`SchedulerOutput` (`free_encoder_keys`).

Sizes are bytes of embeddings (`encoder_cache_memory`). With a budget of 0 (cache off)
entries live only while referenced. One item larger than the whole budget is still
admitted when nothing else is referenced (progress over a strict bound).
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.sizes: dict[str, int] = {}  # key -> bytes, for every entry the runner holds
        self.refs: dict[str, set[int]] = {}  # key -> ids of sequences that need it
        self.freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, LRU first
        self.num_bytes = 0
        self.num_freeable_bytes = 0
        self._freed: list[str] = []  # evicted since the last `take_freed`
        self.num_hits = 0  # items found cached (or scheduled earlier in the same step)
        self.num_misses = 0  # items scheduled for encoding

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def has(self, key: str) -> bool:
        return key in self.sizes

    def holds(self, seq_id: int, key: str) -> bool:
        return seq_id in self.refs.get(key, ())

    def add_ref(self, key: str, seq_id: int) -> None:
        refs = self.refs[key]
        if not refs and key in self.freeable:
            del self.freeable[key]
            self.num_freeable_bytes -= self.sizes[key]
        refs.add(seq_id)

    def can_allocate(self, num_bytes: int) -> bool:
        if not self.enabled:
            return True
        referenced = self.num_bytes - self.num_freeable_bytes
        return referenced == 0 or referenced + num_bytes <= self.budget_bytes

    def allocate(self, key: str, seq_id: int, num_bytes: int) -> None:
        """Reserve room for an entry the runner encodes in this step (evicting LRU entries)."""
        if self.enabled:
            while self.freeable and self.num_bytes + num_bytes > self.budget_bytes:
                self._drop(next(iter(self.freeable)))
        self.sizes[key] = num_bytes
        self.refs[key] = {seq_id}
        self.num_bytes += num_bytes
        self.num_misses += 1

    def release(self, key: str, seq_id: int) -> None:
        refs = self.refs.get(key)
        if refs is None or seq_id not in refs:
            return
        refs.discard(seq_id)
        if not refs:
            if self.enabled:
                self.freeable[key] = None
                self.num_freeable_bytes += self.sizes[key]
            else:
                self._drop(key)

    def release_all(self, seq_id: int, keys: list[str]) -> None:
        for key in keys:
            self.release(key, seq_id)

    def forget(self, keys: list[str]) -> None:
        """Drop entries whose encoding never happened (the step that would compute them failed)."""
        for key in keys:
            if key in self.sizes:
                self._drop(key)

    def requeue_freed(self, keys: tuple[str, ...]) -> None:
        """Keys handed to a runner that never ran: hand them over again next step."""
        self._freed[:0] = keys

    def take_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def _drop(self, key: str) -> None:
        size = self.sizes.pop(key)
        self.num_bytes -= size
        self.refs.pop(key, None)
        if key in self.freeable:
            del self.freeable[key]
            self.num_freeable_bytes -= size
        self._freed.append(key)
