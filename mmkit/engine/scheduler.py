"""Scheduler: FCFS continuous batching with token and sequence budgets.

Every sequence tracks `num_computed_tokens`; a step schedules, per sequence, the next chunk
of tokens whose K/V is missing: one token for a decoding sequence, up to the whole prompt
for a new one (chunked when it exceeds the token budget). Running sequences go first; when
blocks run out the most recently arrived running sequence is preempted (its blocks are
freed and it is recomputed later). New requests are admitted only in steps without
preemption, so a preempted request is not starved by newcomers.

Encoder work is scheduled here too (vLLM v1): a chunk that covers an item's placeholder
range needs the item's embedding in the runner's encoder cache. A cached item gains a
reference; a missing one is scheduled for encoding within the step's encoder budget
(`max_num_encoder_input_tokens`) and the cache's room (`EncoderCacheManager`); when neither
allows it the chunk stops before that item and the item waits for a later step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager
from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.hashing import update_block_hashes
from mmkit.inputs import ImageItem


@dataclass(frozen=True)
class EncoderInput:
    """One item the runner encodes in this step and stores under `key`."""

    request_id: str
    key: str
    item: ImageItem | None  # a raw image: the processor builds its model inputs
    embeds: torch.Tensor | None  # or embeddings given by the user, [num_tokens, hidden]
    num_tokens: int  # rows expected (the item's placeholder range length)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence (so a token is sampled)."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    published_blocks: list[int] = field(default_factory=list)  # prefix-cache entries of this step
    # Sequences that could not get one more block even alone in the cache: finished "length".
    out_of_cache: list[Sequence] = field(default_factory=list)
    encoder_inputs: list[EncoderInput] = field(default_factory=list)  # to encode, in order
    free_encoder_keys: tuple[str, ...] = ()  # entries the runner drops (before encoding)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 encoder_cache: EncoderCacheManager | None = None, encoder_row_bytes: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache or EncoderCacheManager(0)
        self.encoder_row_bytes = encoder_row_bytes  # bytes of one embedding row (hidden * dtype)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add_group(self, group: SequenceGroup) -> None:
        # Only the first sequence is prefilled; the others fork from it (see Sequence).
        self.waiting.append(group.seqs[0])

    def abort_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
            seq.num_pending_forks = 0
        group.pending_forks = []

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._release_encoder_inputs(seq)
        seq.status = status

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.config.max_num_batched_tokens
        self._encoder_budget = self.config.max_num_encoder_input_tokens or token_budget
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, token_budget)
            if not self._make_room(seq, num_new, out, scheduled_ids):
                continue  # `seq` itself was preempted or finished; running[i] is the next one
            i += 1
            num_new = self._schedule_encoder_inputs(seq, seq.num_computed_tokens, num_new, out)
            if num_new == 0:
                continue  # waits for room in the encoder cache or budget
            self._allocate(seq, num_new, out)
            scheduled_ids.add(seq.seq_id)
            token_budget -= num_new
        if out.num_preempted == 0:
            token_budget = self._admit_waiting(out, token_budget)
        out.free_encoder_keys = self.encoder_cache.take_freed()
        return out

    def finish_step(self, out: SchedulerOutput) -> None:
        """After the runner computed `out`: release encoder entries whose items are fully
        computed (vLLM frees them at the same point)."""
        for s in out.scheduled:
            seq = s.seq
            ranges = seq.group.processed.placeholder_ranges
            if ranges and seq.group.encoder_keys is not None:
                done = seq.num_computed_tokens
                for key, (offset, length) in zip(seq.group.encoder_keys, ranges):
                    if offset + length <= done:
                        self.encoder_cache.release(key, seq.seq_id)

    def step_failed(self, out: SchedulerOutput) -> None:
        """The runner did not compute `out`: nothing it was to encode or publish exists."""
        self.block_manager.forget(out.published_blocks)
        self.encoder_cache.forget([e.key for e in out.encoder_inputs])
        self.encoder_cache.requeue_freed(out.free_encoder_keys)

    # ------------------------------------------------------------------ encoder inputs
    def encoder_keys(self, group: SequenceGroup) -> list[str]:
        """Encoder-cache key per item: its content hash (shared by equal images) or, with
        the cache off, a key private to the request."""
        if group.encoder_keys is None:
            if self.encoder_cache.enabled:
                group.encoder_keys = list(group.get_image_hashes())
            else:
                group.encoder_keys = [f"{group.request_id}/{i}" for i in range(len(group.processed.placeholder_ranges))]
        return group.encoder_keys

    def _schedule_encoder_inputs(self, seq: Sequence, start: int, num_new: int, out: SchedulerOutput) -> int:
        """Reference or schedule the items chunk [start, start + num_new) covers; returns the
        (possibly shortened) number of tokens to schedule."""
        group = seq.group
        ranges = group.processed.placeholder_ranges
        if not ranges:
            return num_new
        end = start + num_new
        keys = self.encoder_keys(group)
        cache = self.encoder_cache
        for i, (offset, length) in enumerate(ranges):
            if offset >= end:
                break
            if offset + length <= start or cache.holds(seq.seq_id, keys[i]):
                continue
            if cache.has(keys[i]):  # cached, or scheduled earlier in this step
                cache.add_ref(keys[i], seq.seq_id)
                cache.num_hits += 1
                continue
            num_bytes = length * self.encoder_row_bytes
            over_budget = length > self._encoder_budget and bool(out.encoder_inputs)
            if over_budget or not cache.can_allocate(num_bytes):
                return max(offset - start, 0)  # stop before this item
            cache.allocate(keys[i], seq.seq_id, num_bytes)
            self._encoder_budget -= length
            embeds = group.processed.image_embeds
            out.encoder_inputs.append(EncoderInput(
                group.request_id, keys[i],
                group.processed.images[i] if embeds is None else None,
                embeds[i] if embeds is not None else None, length))
        return num_new

    def _release_encoder_inputs(self, seq: Sequence) -> None:
        if seq.group is not None and seq.group.encoder_keys is not None:
            self.encoder_cache.release_all(seq.seq_id, seq.group.encoder_keys)

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput,
                   scheduled_ids: set[int]) -> bool:
        """Preempt the newest running sequences until `seq` can allocate; False if `seq` left."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running[-1]
            if victim is seq:
                if len(self.running) == 1:
                    # Alone in the cache and still no room: it can never grow further.
                    self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                    out.out_of_cache.append(seq)
                else:
                    self._preempt(seq, out)
                return False
            if victim.seq_id in scheduled_ids:  # pragma: no cover - victims come after `seq`
                raise AssertionError("preempting an already scheduled sequence")
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_encoder_inputs(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.num_preempted += 1

    def _allocate(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        out.block_copies.extend(bm.allocate(seq, num_new))
        out.scheduled.append(ScheduledSeq(seq, num_new))
        if bm.enable_prefix_caching:
            update_block_hashes(seq, bm.block_size)
            out.published_blocks.extend(bm.register_full_blocks(seq, seq.num_computed_tokens + num_new))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        bm = self.block_manager
        # Prompt logprobs need the logits of every prompt position: no skipping for them.
        if not bm.enable_prefix_caching or seq.group.params.prompt_logprobs is not None:
            return []
        update_block_hashes(seq, bm.block_size)
        return bm.find_cached_prefix(seq)

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> int:
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            start = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - start, token_budget)
            if not self.block_manager.can_allocate_with_prefix(seq, hits, num_new):
                break
            num_new = self._schedule_encoder_inputs(seq, start, num_new, out)
            if num_new == 0:
                break
            self.waiting.popleft()
            if self.block_manager.enable_prefix_caching:
                self.block_manager.use_cached_prefix(seq, hits, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._allocate(seq, num_new, out)
            token_budget -= num_new
        return token_budget
