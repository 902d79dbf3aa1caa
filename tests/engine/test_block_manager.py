"""The block manager owns the block tables (vLLM v1's `req_to_blocks`) and the scheduler forks
n > 1 samples through `SequenceGroup`: model-free unit tests of both, deterministic (the
Hypothesis machine in test_properties.py covers random interleavings)."""

from __future__ import annotations

import pytest

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import NULL_BLOCK, BlockManager
from mmkit.engine.block_hashes import update_block_hashes
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams


def group(token_ids, n: int = 1, rid: str = "r") -> SequenceGroup:
    processed = ProcessedPrompt(index=0, prompt=None, prompt_token_ids=list(token_ids))
    return SequenceGroup.create(rid, processed, SamplingParams(n=n, temperature=1.0), list(range(n)))


def test_sequences_hold_no_block_table():
    seq = group([1, 2, 3]).seqs[0]
    assert not hasattr(seq, "block_table")


def test_allocate_fork_copy_on_write_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = group(list(range(6)), n=2).seqs[0]
    child = parent.group.pending_forks[0]
    assert bm.get_block_ids(parent) == () and bm.allocate(parent, 6) == []
    table = bm.get_block_ids(parent)
    assert len(table) == 2 and bm.num_free_blocks == 6
    parent.num_computed_tokens = 6
    bm.fork(parent, child)
    child.num_computed_tokens = 6
    assert bm.get_block_ids(child) == table and all(bm.ref_counts[b] == 2 for b in table)
    assert bm.num_new_blocks(child, 1) == 1  # its first write lands in the shared partial block
    copies = bm.allocate(child, 1)
    assert copies == [(table[1], bm.get_block_ids(child)[1])] and bm.get_block_ids(child)[0] == table[0]
    assert bm.ref_counts[table[1]] == 1 and bm.ref_counts[table[0]] == 2
    assert bm.block_ids_from(child, 1) == bm.get_block_ids(child)[1:] and bm.num_held_blocks(child) == 2
    bm.free(parent)
    bm.free(child)
    assert bm.req_to_blocks == {} and bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_prefix_cache_hit_gives_the_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    first = group([5, 6, 7, 8, 9], rid="a").seqs[0]
    update_block_hashes(first, 2)
    bm.allocate(first, 5)
    published = bm.register_full_blocks(first, 5)
    assert published == list(bm.get_block_ids(first)[:2])
    second = group([5, 6, 7, 8, 1], rid="b").seqs[0]
    update_block_hashes(second, 2)
    hits = bm.find_cached_prefix(second)
    assert hits == published
    computed = bm.use_cached_prefix(second, hits, second.num_tokens)
    assert bm.get_block_ids(second) == tuple(hits) and computed == 4
    assert bm.num_cache_hits == 4 and all(bm.ref_counts[b] == 2 for b in hits)


def test_sliding_window_releases_a_prefix_of_the_table():
    bm = BlockManager(num_blocks=8, block_size=2, sliding_window=3)
    seq = group(list(range(8))).seqs[0]
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    assert bm.free_out_of_window(seq) == 3  # positions 0-5 lie before the window of position 8
    assert bm.get_block_ids(seq)[:3] == (NULL_BLOCK,) * 3 and bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == 8


def step(sched: Scheduler, token: int = 100):
    """One engine step without a model: every chunk that reaches its sequence's end samples
    (n rows for a prompt whose samples fork)."""
    out = sched.schedule()
    by_id = {s.seq_id: s for g in sched.requests.values() for s in g.seqs}
    sampled = [i for i, n in out.num_scheduled_tokens.items()
               if by_id[i].num_computed_tokens + n == by_id[i].num_tokens]
    counts = [1 + by_id[i].num_pending_forks for i in sampled]
    sched.update_from_output(out, sampled, counts, [token + k for k in range(sum(counts))])
    return out


def test_scheduler_forks_n_samples_once_and_shares_the_prompt_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    request = group(list(range(10)), n=3)
    sched.add_request(request)
    first = step(sched)
    assert len(first.new_seqs) == 1 and first.new_seqs[0].pending_forks  # only the first is prefilled
    assert [s.token_ids[-1] for s in request.seqs] == [100, 101, 102] and request.pending_forks == []
    tables = [bm.get_block_ids(s) for s in request.seqs]
    assert tables[0] == tables[1] == tables[2] and bm.num_free_blocks == 16 - 3
    step(sched)  # every sample writes its own token: the shared partial block is copied twice
    tables = [bm.get_block_ids(s) for s in request.seqs]
    assert len({t[2] for t in tables}) == 3 and len({t[0] for t in tables}) == 1
    assert sched.abort_request("r") is request
    assert bm.req_to_blocks == {} and bm.num_free_blocks == 16
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in request.seqs)


def test_abort_before_the_fork_drops_the_pending_samples():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16), bm)
    request = group([1, 2, 3], n=4)
    children = list(request.pending_forks)
    sched.add_request(request)
    assert sched.abort_request("r") is request
    assert request.pending_forks == [] and request.is_finished and request.seqs[0].num_pending_forks == 0
    out = sched.schedule()
    assert out.is_empty and {c.seq_id for c in children} <= out.finished_seq_ids  # the runner forgets them too


def test_preemption_frees_the_victims_table():
    bm = BlockManager(num_blocks=3, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16), bm)
    a, b = group([1, 2], rid="a").seqs[0], group([3, 4], rid="b").seqs[0]
    sched.add_request(a.group)
    sched.add_request(b.group)
    step(sched)  # both prompts, one block each; each samples a third token
    assert a.num_tokens == b.num_tokens == 3 and bm.num_free_blocks == 1
    step(sched)  # a takes the last block, b (the newest) is preempted to make room
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    assert bm.get_block_ids(b) == () and b.num_computed_tokens == 0 and b.seq_id not in bm.req_to_blocks
    assert len(bm.get_block_ids(a)) == 2 and bm.num_free_blocks == 1
