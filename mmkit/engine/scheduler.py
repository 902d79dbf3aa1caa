"""Scheduler: owns the requests; FCFS continuous batching with token and sequence budgets.

Every sequence tracks `num_computed_tokens`; a step schedules, per sequence, the next chunk
of tokens whose K/V is missing: one token for a decoding sequence, up to the whole prompt
for a new one (chunked when it exceeds the token budget). Running sequences go first; when
blocks run out the most recently arrived running sequence is preempted (its blocks are
freed and it is recomputed later). New requests are admitted only in steps without
preemption, so a preempted request is not starved by newcomers.

Encoder work is scheduled here too (vLLM v1), by `EncoderScheduler`
(mmkit/engine/encoder_scheduling.py): a chunk stops before an item that neither the encoder
budget nor the encoder cache has room for.

`schedule()` returns a frozen `SchedulerOutput` (mmkit/engine/scheduler_output.py); after the
runner computed it, `update_from_output` advances the counters and appends sampled tokens.
The scheduler keeps the step's mutable bookkeeping (`StepPlan`) itself. Every request has one
sample (vLLM v1): n > 1 arrives as n independent requests (engine/parent_request.py), which
share the prompt's blocks through the prefix cache, so nothing is forked or copied here.
The block manager decides and returns (cached prefixes and their token counts, new block
ids); the scheduler alone writes what a request records of it (`num_computed_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager
from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.engine.encoder_scheduling import EncoderScheduler
from mmkit.engine.seq_queue import SeqQueue
from mmkit.engine.state_cache_manager import StateCacheManager
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.engine.block_hashes import update_block_hashes
from mmkit.engine.scheduler_output import CachedSeqData, EncoderInput, NewSeqData, SchedulerOutput


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [start, start + num_new_tokens)
    start: int
    new_block_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class StepPlan:
    """The scheduler's own record of the step in flight (never given to the runner)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    published_blocks: list[int] = field(default_factory=list)  # prefix-cache entries of this step
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # from the waiting queue, in order


@dataclass
class StepUpdate:
    """What `update_from_output` changed, for the output processor."""

    scheduled: dict[int, Sequence]  # seq_id -> sequence computed in the step
    samples: list[tuple[Sequence, int]]  # (sequence, sampler row) per new token, in row order


class PreprocessTracker(Protocol):
    """What the scheduler asks the engine's input stage (mmkit/multimodal/stage.py) when it
    prepares items ahead on worker threads."""

    def is_ready(self, request_id: str) -> bool:
        """Every image of the request is prepared (or never was the tracker's)."""

    def requeue(self, request_id: str) -> None:
        """A preempted request: prepare its images again if they were freed (it is re-admitted
        only once they are ready, as a new waiting request is)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 encoder_cache: EncoderCacheManager | None = None, encoder_row_bytes: int = 0,
                 preprocess: PreprocessTracker | None = None,
                 state_cache: StateCacheManager | None = None) -> None:
        self.config = config
        # A hybrid decoder's per-request state slots (None: KV blocks only): a slot is taken when
        # the runner first gets a sequence, given back on finish, abort and preemption.
        self.state_cache = state_cache
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache or EncoderCacheManager(0)
        self.encoder = EncoderScheduler(self.encoder_cache, encoder_row_bytes,
                                        config.max_num_encoder_input_tokens or config.max_num_batched_tokens,
                                        lora_tower=config.lora_tower)
        self.requests: dict[str, SequenceGroup] = {}  # every unfinished request
        # Ordered sets: a finished, aborted or preempted sequence leaves in O(1).
        self._waiting = SeqQueue()
        self._running = SeqQueue()
        self.num_preemptions = 0
        self._known_to_runner: set[int] = set()  # seq ids the runner holds a state for
        self._finished_seq_ids: set[int] = set()  # to tell the runner in the next step
        self._finished_while_scheduling: list[Sequence] = []  # out of KV cache: "length"
        self._plan: StepPlan | None = None
        # The engine's input stage when it prefetches (see `PreprocessTracker`); None: items are
        # processed when the runner reaches them.
        self.preprocess = preprocess

    # ------------------------------------------------------------------ queue management
    @property
    def waiting(self) -> SeqQueue:
        return self._waiting

    @waiting.setter
    def waiting(self, seqs) -> None:
        self._waiting = SeqQueue(seqs)

    @property
    def running(self) -> SeqQueue:
        return self._running

    @running.setter
    def running(self, seqs) -> None:
        self._running = SeqQueue(seqs)

    def add_request(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group
        self.waiting.append(group.seq)

    def abort_request(self, request_id: str) -> SequenceGroup | None:
        group = self.requests.pop(request_id, None)
        if group is not None:
            self.finish_seq(group.seq, SequenceStatus.FINISHED_ABORTED)
        return group

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.encoder.release(seq)
        if self.state_cache is not None:
            self.state_cache.free(seq.seq_id)
        seq.status = status
        self._known_to_runner.discard(seq.seq_id)
        self._finished_seq_ids.add(seq.seq_id)

    def remove_if_finished(self, group: SequenceGroup) -> bool:
        """Forget a finished request (its outputs are built); True if it was removed now."""
        if group.is_finished and self.requests.get(group.request_id) is group:
            del self.requests[group.request_id]
            return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished_while_scheduling(self) -> list[Sequence]:
        done, self._finished_while_scheduling = self._finished_while_scheduling, []
        return done

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan()
        token_budget = self.config.max_num_batched_tokens
        self.encoder.start_step()
        scheduled_ids: set[int] = set()
        # NOTE: preemption takes victims from the tail of `running`, so a sequence of this
        # snapshot that no longer runs comes after every one that still does.
        for seq in list(self.running):
            if token_budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            num_new = seq.num_tokens_whole_spans(seq.num_computed_tokens,
                                                 min(seq.num_tokens - seq.num_computed_tokens, token_budget))
            if not self._make_room(seq, num_new, plan, scheduled_ids):
                continue  # `seq` itself was preempted or finished
            num_new = self.encoder.schedule(seq, seq.num_computed_tokens, num_new, plan.encoder_inputs)
            if num_new == 0:
                continue  # waits for room in the encoder cache or budget
            self._allocate(seq, num_new, plan)
            scheduled_ids.add(seq.seq_id)
            token_budget -= num_new
        if plan.num_preempted == 0:
            self._admit_waiting(plan, token_budget)
        self._plan = plan
        return self._freeze(plan)

    def _freeze(self, plan: StepPlan) -> SchedulerOutput:
        new, cached = [], []
        for s in plan.scheduled:
            seq = s.seq
            if seq.seq_id in self._known_to_runner:
                cached.append(CachedSeqData(seq.seq_id, s.new_block_ids, s.start))
            else:
                new.append(self._new_seq_data(seq, s.start))
                self._known_to_runner.add(seq.seq_id)
        finished, self._finished_seq_ids = frozenset(self._finished_seq_ids), set()
        return SchedulerOutput(
            new_seqs=tuple(new), cached_seqs=tuple(cached),
            num_scheduled_tokens={s.seq.seq_id: s.num_new_tokens for s in plan.scheduled},
            finished_seq_ids=finished,
            encoder_inputs=tuple(plan.encoder_inputs), free_encoder_keys=self.encoder_cache.take_freed())

    def _new_seq_data(self, seq: Sequence, num_computed: int) -> NewSeqData:
        group = seq.group
        processed = group.processed
        ranges = tuple(processed.placeholder_ranges)
        return NewSeqData(
            seq_id=seq.seq_id, request_id=group.request_id,
            token_ids=tuple(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
            sampling_params=group.params, seed=seq.seed, block_ids=self.block_manager.get_block_ids(seq),
            num_computed_tokens=num_computed, placeholder_ranges=ranges,
            encoder_keys=tuple(self.encoder.keys(group)) if ranges else (),
            mrope_positions=processed.mrope_positions, mrope_position_delta=processed.mrope_position_delta,
            bidirectional_ranges=tuple(map(tuple, processed.bidirectional_ranges)),
            lora_request=getattr(processed, "lora_request", None),
            state_slot=self.state_cache.allocate(seq.seq_id) if self.state_cache is not None else -1)

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan, scheduled_ids: set[int]) -> bool:
        """Preempt the newest running sequences until `seq` can allocate; False if `seq` left."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running[-1]
            if victim is seq:
                if len(self.running) == 1:
                    # Alone in the cache and still no room: it can never grow further.
                    self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                    self._finished_while_scheduling.append(seq)
                else:
                    self._preempt(seq, plan)
                return False
            if victim.seq_id in scheduled_ids:  # pragma: no cover - victims come after `seq`
                raise AssertionError("preempting an already scheduled sequence")
            self._preempt(victim, plan)
        return True

    def _preempt(self, seq: Sequence, plan) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.encoder.release(seq)
        if self.state_cache is not None:  # recomputed from token 0: the state is rebuilt
            self.state_cache.free(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        if self.preprocess is not None:  # its items' inputs go back to the workers
            self.preprocess.requeue(seq.group.request_id)
        self._known_to_runner.discard(seq.seq_id)  # resent whole when it resumes
        self.num_preemptions += 1
        plan.num_preempted += 1

    def _allocate(self, seq: Sequence, num_new: int, plan: StepPlan) -> None:
        bm = self.block_manager
        start = seq.num_computed_tokens
        new_block_ids = bm.allocate(seq, num_new)
        plan.scheduled.append(ScheduledSeq(seq, num_new, start, tuple(new_block_ids)))
        if bm.enable_prefix_caching:
            update_block_hashes(seq, bm.block_size)
            plan.published_blocks.extend(bm.register_full_blocks(seq, start + num_new))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return []
        params = seq.group.params
        # Prompt logprobs need the hidden rows from position prompt_logprobs_start - 1 on:
        # only whole blocks before that row may come from the cache.
        limit = None if params.prompt_logprobs is None else \
            max(params.first_prompt_logprob(seq.num_prompt_tokens) - 1, 0) // bm.block_size
        if limit == 0:
            return []
        update_block_hashes(seq, bm.block_size)
        hits = bm.find_cached_prefix(seq)
        return hits if limit is None else hits[:limit]

    def _admit_waiting(self, plan: StepPlan, token_budget: int) -> int:
        # NOTE: a waiting request whose images are still being prepared waits (the forward
        # pass never waits for PIL), and the scheduler never blocks on the input stage. With
        # nothing running, the engine (which owns the stage) has already waited for the
        # requests this step will likely admit (`likely_admitted`, before `schedule`), so a
        # batch given to an idle engine is admitted as the synchronous path admits it,
        # whatever the workers' speed: one prefill for all, and the same preemptions on any
        # host. Arrival order is kept.
        # LoRA: a step holds at most max_loras adapters (the model's slots); a request whose
        # adapter would be one more waits, keeping its place, and those behind it may go (vLLM's rule).
        skipped: list[Sequence] = []
        loras = {s.group.processed.lora_request.lora_int_id for s in self.running
                 if getattr(s.group.processed, "lora_request", None) is not None} if self.config.max_loras else set()
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            lora = getattr(seq.group.processed, "lora_request", None)
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if self.preprocess is not None and not self.preprocess.is_ready(seq.group.request_id):
                break
            hits = self._cached_prefix(seq)
            start = len(hits) * self.block_manager.block_size
            num_new = seq.num_tokens_whole_spans(start, min(seq.num_tokens - start, token_budget))
            if not self.block_manager.can_allocate_with_prefix(seq, hits, num_new):
                break
            num_new = self.encoder.schedule(seq, start, num_new, plan.encoder_inputs)
            if num_new == 0:
                break
            self.waiting.popleft()
            if self.block_manager.enable_prefix_caching:
                seq.num_computed_tokens = self.block_manager.use_cached_prefix(seq, hits, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
            if lora is not None:
                loras.add(lora.lora_int_id)
            self._allocate(seq, num_new, plan)
            token_budget -= num_new
        for seq in reversed(skipped):
            self.waiting.appendleft(seq)
        return token_budget

    def likely_admitted(self) -> list[str]:
        """With nothing running: the waiting requests the next step would likely admit, by
        prompt length (cache hits aside), so the engine can have their images prepared side
        by side before it schedules. Running requests: none (they fill the step first)."""
        if self.running:
            return []
        token_budget = self.config.max_num_batched_tokens
        ids, room = [], self.config.max_num_seqs
        for seq in self.waiting:
            if token_budget <= 0 or len(ids) >= room:
                break
            ids.append(seq.group.request_id)
            token_budget -= seq.num_tokens - seq.num_computed_tokens
        return ids

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, sched: SchedulerOutput, sampled_seq_ids: list[int],
                           token_ids: list[int]) -> StepUpdate:
        """Advance the counters of the computed step and append the sampled tokens (one per
        sampled sequence, in sampler row order)."""
        plan, self._plan = self._plan, None
        by_id = {}
        for s in plan.scheduled:
            s.seq.num_computed_tokens = s.end
            by_id[s.seq.seq_id] = s.seq
            # Every layer slides: blocks entirely before the next query's window go back.
            self.block_manager.free_out_of_window(s.seq)
        for s in plan.scheduled:
            self.encoder.release_computed(s.seq)
        samples: list[tuple[Sequence, int]] = []
        for row, seq_id in enumerate(sampled_seq_ids):
            seq = by_id[seq_id]
            seq.token_ids.append(token_ids[row])
            samples.append((seq, row))
        return StepUpdate(by_id, samples)

    def step_failed(self, sched: SchedulerOutput) -> None:
        """The runner did not compute `sched`: nothing it was to encode or publish exists,
        and its per-sequence states are rebuilt from scratch next time."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self.block_manager.forget(plan.published_blocks)
        for s in plan.scheduled:  # their blocks are registered again when computed
            self.block_manager.reconsider(s.seq)
        self.encoder_cache.forget([e.key for e in plan.encoder_inputs])
        self.encoder_cache.requeue_freed(sched.free_encoder_keys)
        self._finished_seq_ids |= sched.finished_seq_ids
        for s in plan.scheduled:
            self._known_to_runner.discard(s.seq.seq_id)
        if self.state_cache is not None:
            # NOTE: the failed forward may have advanced some layers' state in place: a hybrid
            # sequence of the step is recomputed from token 0 (KV blocks alone could resume).
            for s in reversed(plan.scheduled):
                if s.seq.status is SequenceStatus.RUNNING and s.seq not in plan.admitted:
                    self.running.remove(s.seq)
                    self.block_manager.free(s.seq)
                    self.encoder.release(s.seq)
                    self.state_cache.free(s.seq.seq_id)
                    s.seq.reset_for_recompute()
                    self.waiting.appendleft(s.seq)
                    if self.preprocess is not None:
                        self.preprocess.requeue(s.seq.group.request_id)
        # NOTE: a sequence admitted in this step may hold prefix-cache hits on blocks that
        # the step was to compute: undo its admission (it is recomputed from scratch).
        for seq in reversed(plan.admitted):
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
                self.block_manager.free(seq)
                self.encoder.release(seq)
                if self.state_cache is not None:
                    self.state_cache.free(seq.seq_id)
                seq.reset_for_recompute()
                self.waiting.appendleft(seq)
