"""The scheduler's encoder part (vLLM v1): which items a step encodes, and their references.

A chunk that covers an item's placeholder range needs the item's embedding in the runner's
encoder cache. A cached item gains a reference; a missing one is scheduled for encoding
within the step's encoder budget (`max_num_encoder_input_tokens`, placeholder tokens) and
the cache's room (`EncoderCacheManager`); when neither allows it the chunk stops before that
item, which waits for a later step. References are released once the item is computed.
"""

from __future__ import annotations

from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.engine.sequence import Sequence, SequenceGroup
from mmkit.engine.scheduler_output import EncoderInput


class EncoderScheduler:
    def __init__(self, cache: EncoderCacheManager, row_bytes: int, max_tokens_per_step: int,
                 lora_tower: bool = False) -> None:
        self.cache = cache
        self.lora_tower = lora_tower  # LoRA on the tower/projector: keys name the request's adapter
        self.row_bytes = row_bytes  # bytes of one embedding row (hidden * dtype)
        self.max_tokens_per_step = max_tokens_per_step
        self.budget = max_tokens_per_step

    def start_step(self) -> None:
        self.budget = self.max_tokens_per_step

    def keys(self, group: SequenceGroup) -> list[str]:
        """Encoder-cache key per item: its content hash (shared by equal images) or, with
        the cache off, a key private to the request."""
        if group.encoder_keys is None:
            if self.cache.enabled:
                group.encoder_keys = list(group.get_image_hashes())
                lora = getattr(group.processed, "lora_request", None)
                if self.lora_tower and lora is not None:  # embeddings computed under that adapter
                    group.encoder_keys = [f"{k}@lora{lora.lora_int_id}" for k in group.encoder_keys]
            else:
                group.encoder_keys = [f"{group.request_id}/{i}" for i in range(len(group.processed.placeholder_ranges))]
        return group.encoder_keys

    def schedule(self, seq: Sequence, start: int, num_new: int, inputs: list[EncoderInput]) -> int:
        """Reference or schedule (append to `inputs`) the items chunk [start, start + num_new)
        covers; returns the (possibly shortened) number of tokens to schedule."""
        group = seq.group
        ranges = group.processed.placeholder_ranges
        if not ranges:
            return num_new
        end = start + num_new
        keys = self.keys(group)
        cache = self.cache
        for i, (offset, length) in enumerate(ranges):
            if offset >= end:
                break
            if offset + length <= start or cache.holds(seq.seq_id, keys[i]):
                continue
            if cache.has(keys[i]):  # cached, or scheduled earlier in this step
                cache.add_ref(keys[i], seq.seq_id)
                cache.num_hits += 1
                continue
            num_bytes = length * self.row_bytes
            # One item larger than the budget is still encoded, alone (progress).
            over_budget = length > self.budget and bool(inputs)
            if over_budget or not cache.can_allocate(num_bytes):
                return max(offset - start, 0)  # stop before this item
            cache.allocate(keys[i], seq.seq_id, num_bytes)
            self.budget -= length
            embeds = group.processed.image_embeds
            given = embeds[i] if embeds is not None else None  # None: an item mmkit encodes
            inputs.append(EncoderInput(
                group.request_id, keys[i],
                group.processed.images[i] if given is None else None, given, length,
                getattr(group.processed, "lora_request", None) if self.lora_tower else None))
        return num_new

    def release_computed(self, seq: Sequence) -> None:
        """Items fully computed need no embedding any more (vLLM frees them at this point)."""
        keys = seq.group.encoder_keys
        if keys is not None:
            done = seq.num_computed_tokens
            for key, (offset, length) in zip(keys, seq.group.processed.placeholder_ranges):
                if offset + length <= done:
                    self.cache.release(key, seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """All references of a sequence that stops or is preempted."""
        if seq.group is not None and seq.group.encoder_keys is not None:
            self.cache.release_all(seq.seq_id, seq.group.encoder_keys)
