"""Scheduler: FCFS continuous batching with token and sequence budgets.

Every sequence tracks `num_computed_tokens`; a step schedules, per sequence, the next chunk
of tokens whose K/V is missing: one token for a decoding sequence, up to the whole prompt
for a new one (chunked when it exceeds the token budget). Running sequences go first; when
blocks run out the most recently arrived running sequence is preempted (its blocks are
freed and it is recomputed later). New requests are admitted only in steps without
preemption, so a preempted request is not starved by newcomers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.hashing import update_block_hashes


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

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
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
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, token_budget)
            if not self._make_room(seq, num_new, out, scheduled_ids):
                continue  # `seq` itself was preempted or finished; running[i] is the next one
            self._allocate(seq, num_new, out)
            scheduled_ids.add(seq.seq_id)
            token_budget -= num_new
            i += 1
        if out.num_preempted == 0:
            token_budget = self._admit_waiting(out, token_budget)
        return out

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
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, token_budget)
            if not self.block_manager.can_allocate_with_prefix(seq, hits, num_new):
                break
            self.waiting.popleft()
            if self.block_manager.enable_prefix_caching:
                self.block_manager.use_cached_prefix(seq, hits, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._allocate(seq, num_new, out)
            token_budget -= num_new
        return token_budget
