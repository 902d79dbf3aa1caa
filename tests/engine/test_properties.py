"""Stateful property tests of the Scheduler and BlockManager, without a model.

Hypothesis drives random sequences of add / step / abort / finish on a small cache (so
preemption by recompute happens often); a step is driven the way LLMEngine.step does it:
schedule, then the scheduler's own `update_from_output` with one sampled token for every
sequence whose chunk reached its end, then stop conditions. A request with n > 1 samples is
fanned out into n requests as LLMEngine does (`engine/parent_request.py`), and an abort
ends all of them.
After every rule the block accounting must be exact, and after draining every request must
have ended finished or aborted with every block free. Runs with and without prefix caching
(when the BlockManager supports it); nothing here depends on attributes beyond
can_allocate / allocate / free / num_free_blocks / ref_counts.
"""

import inspect
import itertools
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager, blocks_needed
from mmkit.engine.parent_request import fan_out
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams

# A few prompts that share prefixes, so a prefix cache (if enabled) gets hits.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [1, 2, 3], [20, 21], [30],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17]]
_SUPPORTS_PREFIX = "enable_prefix_caching" in inspect.signature(BlockManager).parameters


def make_block_manager(num_blocks: int, block_size: int, prefix_caching: bool) -> BlockManager:
    if _SUPPORTS_PREFIX:
        return BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return BlockManager(num_blocks, block_size)


def free_ids(bm) -> list[int]:
    ids = getattr(bm, "free_block_ids", None)
    if ids is None:
        ids = getattr(bm, "free_blocks")
    return list(ids)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 14), block_size=st.sampled_from([1, 2, 4]),
                max_num_seqs=st.integers(1, 4), max_batched=st.integers(1, 24),
                max_model_len=st.integers(8, 64), prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, max_num_seqs, max_batched, max_model_len, prefix_caching):
        self.bm = make_block_manager(num_blocks, block_size, prefix_caching and _SUPPORTS_PREFIX)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                               max_model_len=max_model_len), self.bm)
        self.max_model_len = max_model_len
        self.groups: dict[str, SequenceGroup] = {}  # live requests (the engine's `groups`)
        self.all_groups: dict[str, SequenceGroup] = {}
        self.parents: dict[str, list[str]] = {}  # user request -> its scheduler requests
        self.aborted: set[str] = set()
        self.ids = itertools.count()
        self.next_token = itertools.count(100)

    # ------------------------------------------------------------------ rules
    @rule(prompt=st.sampled_from(PROMPTS), extra=st.integers(0, 6), n=st.integers(1, 3),
          max_tokens=st.integers(1, 20))
    def add(self, prompt, extra, n, max_tokens):
        token_ids = prompt + [40 + i for i in range(extra)]
        # LLMEngine._check_fits: a request that can never fit is rejected up front.
        if len(token_ids) > self.max_model_len or blocks_needed(len(token_ids) + 1, self.bm.block_size) > self.bm.num_blocks:
            return
        rid = f"r{next(self.ids)}"
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
        processed = ProcessedPrompt(index=0, prompt=None, prompt_token_ids=token_ids)
        self.parents[rid] = []
        for child in fan_out(rid, params, list(range(n))):
            group = SequenceGroup.create(child.request_id, processed, child.params, child.seed)
            self.groups[child.request_id] = group
            self.all_groups[child.request_id] = group
            self.parents[rid].append(child.request_id)
            self.sched.add_request(group)

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(p for p, children in self.parents.items() if any(c in self.groups for c in children))
        rid = data.draw(st.sampled_from(live))
        for child_id in self.parents[rid]:  # what LLMEngine.abort_request does: every child
            group = self.groups.pop(child_id, None)
            assert self.sched.abort_request(child_id) is group
            if group is not None:
                assert group.seq.is_finished and self.bm.get_block_ids(group.seq) == ()
        self.aborted.add(rid)

    @precondition(lambda self: any(s.num_output_tokens > 0 for s in self.sched.running))
    @rule(data=st.data())
    def finish(self, data):
        """A stop string or EOS ends one running sample early."""
        candidates = [s for s in self.sched.running if s.num_output_tokens > 0]
        seq = data.draw(st.sampled_from(candidates))
        self.sched.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        self._retire(seq.group)

    # ------------------------------------------------------------------ the simulated step
    def _step(self) -> bool:
        preempted_before = self.sched.num_preemptions
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        by_id = {g.seq.seq_id: g.seq for g in self.all_groups.values()}
        scheduled = [(by_id[seq_id], n) for seq_id, n in out.num_scheduled_tokens.items()]
        written: set[int] = set()
        bs = self.bm.block_size
        for seq, num_new in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            assert num_new > 0 and not seq.is_finished and seq.status is SequenceStatus.RUNNING
            assert len(self.bm.get_block_ids(seq)) >= blocks_needed(end, bs)
            blocks = self.bm.get_block_ids(seq)[start // bs: (end - 1) // bs + 1]
            for block_id in blocks:
                assert block_id not in written, f"block {block_id} written by two sequences"
                written.add(block_id)
                # NOTE: a block written this step is this sequence's alone, except that a prefix-cache
                # hit later in the same step may read it (as a full, computed block): never write it.
                holders = [t for t in self._live_seqs() if t is not seq and block_id in self.bm.get_block_ids(t)]
                for other in holders:
                    index = self.bm.get_block_ids(other).index(block_id)
                    assert (index + 1) * bs <= other.num_computed_tokens or any(
                        x is other and x.num_computed_tokens >= (index + 1) * bs for x, _ in scheduled), \
                        f"{seq} writes block {block_id} that {other} may also write"
                if self.bm.ref_counts[block_id] != 1:
                    assert holders and getattr(self.bm, "enable_prefix_caching", False), \
                        (seq, block_id, self.bm.ref_counts[block_id])
        out_of_cache = self.sched.take_finished_while_scheduling()
        for seq in out_of_cache:
            assert seq.is_finished and self.bm.get_block_ids(seq) == ()
            self._retire(seq.group)
        # The runner's part: one row per sampled sequence.
        sampled = [seq for seq, n in scheduled if seq.num_computed_tokens + n == seq.num_tokens]
        tokens = [next(self.next_token) for _ in sampled]
        update = self.sched.update_from_output(out, [s.seq_id for s in sampled], tokens)
        assert [row for _, row in update.samples] == list(range(len(tokens)))
        for target, _row in update.samples:
            params = target.group.params
            if target.num_output_tokens >= params.max_tokens or target.num_tokens >= self.max_model_len:
                self.sched.finish_seq(target, SequenceStatus.FINISHED_LENGTH)
        for seq in sampled:
            self._retire(seq.group)
        # A step that only preempts (or only ends out-of-cache sequences) still makes progress.
        return bool(scheduled or self.sched.num_preemptions > preempted_before or out_of_cache)

    def _live_seqs(self) -> list[Sequence]:
        return [g.seq for g in self.groups.values() if not g.seq.is_finished]

    def _retire(self, group: SequenceGroup) -> None:
        if group.is_finished and self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
            assert self.sched.remove_if_finished(group)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        refs: Counter = Counter()
        for group in self.all_groups.values():
            seq = group.seq
            if seq.is_finished:
                assert self.bm.get_block_ids(seq) == (), f"finished {seq} still holds blocks"
            refs.update(self.bm.get_block_ids(seq))
        assert min(bm.ref_counts) >= 0
        for block_id in range(bm.num_blocks):
            assert bm.ref_counts[block_id] == refs[block_id], (block_id, bm.ref_counts[block_id], refs[block_id])
        free = free_ids(bm)
        assert len(free) == len(set(free)) == bm.num_free_blocks, "a block is on the free list twice"
        assert set(free).isdisjoint(refs), "a referenced block is on the free list"
        assert set(free) | set(refs) == set(range(bm.num_blocks)), "a block leaked"

    @invariant()
    def queues_are_consistent(self):
        if not hasattr(self, "sched"):
            return
        waiting, running = list(self.sched.waiting), self.sched.running
        assert len({id(s) for s in waiting + running}) == len(waiting) + len(running)
        assert all(s.status is SequenceStatus.WAITING and not self.bm.get_block_ids(s) for s in waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        live = {id(g.seq) for g in self.groups.values() if not g.seq.is_finished}
        assert {id(s) for s in waiting + running} == live

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):  # a livelock (preempting forever) ends here and fails below
            if not self.sched.has_unfinished():
                break
            progressed = self._step()
            assert progressed or not self.sched.has_unfinished(), "the scheduler is stuck"
            self.blocks_are_accounted_for()
        assert not self.sched.has_unfinished() and self.groups == {}
        for rid, child_ids in self.parents.items():
            groups = [self.all_groups[c] for c in child_ids]
            statuses = {g.seq.status for g in groups}
            assert all(g.is_finished and g.params.n == 1 for g in groups), (rid, statuses)
            if rid in self.aborted:
                assert SequenceStatus.FINISHED_ABORTED in statuses
            else:
                assert SequenceStatus.FINISHED_ABORTED not in statuses
        assert self.bm.num_free_blocks == self.bm.num_blocks and sum(self.bm.ref_counts) == 0
        event(f"preempted: {self.sched.num_preemptions > 0}")
        event(f"aborted: {bool(self.aborted)}")


SchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase
