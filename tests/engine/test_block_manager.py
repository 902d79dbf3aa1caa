"""The block manager owns the block tables (vLLM v1's `req_to_blocks`) and returns what it
decides (new block ids, cached prefixes and their token counts): model-free unit tests,
deterministic (the Hypothesis machine in test_properties.py covers random interleavings;
test_scheduler_fan_out.py the n > 1 requests)."""

from __future__ import annotations

import pytest

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import NULL_BLOCK, BlockManager
from mmkit.engine.block_hashes import update_block_hashes
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import SequenceGroup, SequenceStatus
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams


def group(token_ids, rid: str = "r") -> SequenceGroup:
    processed = ProcessedPrompt(index=0, prompt=None, prompt_token_ids=list(token_ids))
    return SequenceGroup.create(rid, processed, SamplingParams(temperature=1.0), 0)


def test_sequences_hold_no_block_table():
    seq = group([1, 2, 3]).seq
    assert not hasattr(seq, "block_table")


def test_a_scheduler_request_has_one_sample():
    processed = ProcessedPrompt(index=0, prompt=None, prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match=r"request 'r': a scheduler request has one sample; got n=2 "
                                         r"\(LLMEngine fans n > 1 out into child requests\)"):
        SequenceGroup.create("r", processed, SamplingParams(n=2), 0)


def test_allocate_returns_the_new_blocks_and_free_returns_them_all():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = group(list(range(6))).seq
    assert bm.get_block_ids(seq) == () and bm.num_new_blocks(seq, 6) == 2
    first = bm.allocate(seq, 6)
    assert len(first) == 2 and bm.get_block_ids(seq) == tuple(first) and bm.num_free_blocks == 6
    seq.num_computed_tokens = 6
    assert bm.num_new_blocks(seq, 2) == 0 and bm.allocate(seq, 2) == []  # the partial block has room
    seq.num_computed_tokens = 8
    second = bm.allocate(seq, 1)
    assert len(second) == 1 and bm.get_block_ids(seq) == tuple(first + second)
    assert all(bm.ref_counts[b] == 1 for b in first + second)
    bm.free(seq)
    assert bm.req_to_blocks == {} and bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_prefix_cache_hit_gives_the_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    first = group([5, 6, 7, 8, 9], rid="a").seq
    update_block_hashes(first, 2)
    bm.allocate(first, 5)
    published = bm.register_full_blocks(first, 5)
    assert published == list(bm.get_block_ids(first)[:2])
    second = group([5, 6, 7, 8, 1], rid="b").seq
    update_block_hashes(second, 2)
    hits = bm.find_cached_prefix(second)
    assert hits == published
    computed = bm.use_cached_prefix(second, hits, second.num_tokens)
    assert bm.get_block_ids(second) == tuple(hits) and computed == 4
    assert bm.num_cache_hits == 4 and all(bm.ref_counts[b] == 2 for b in hits)


def test_sliding_window_releases_a_prefix_of_the_table():
    bm = BlockManager(num_blocks=8, block_size=2, sliding_window=3)
    seq = group(list(range(8))).seq
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    assert bm.free_out_of_window(seq) == 3  # positions 0-5 lie before the window of position 8
    assert bm.get_block_ids(seq)[:3] == (NULL_BLOCK,) * 3 and bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == 8


def step(sched: Scheduler, token: int = 100):
    """One engine step without a model: every chunk that reaches its sequence's end samples."""
    out = sched.schedule()
    by_id = {g.seq.seq_id: g.seq for g in sched.requests.values()}
    sampled = [i for i, n in out.num_scheduled_tokens.items()
               if by_id[i].num_computed_tokens + n == by_id[i].num_tokens]
    sched.update_from_output(out, sampled, [token + k for k in range(len(sampled))])
    return out


def test_preemption_frees_the_victims_table():
    bm = BlockManager(num_blocks=3, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16), bm)
    a, b = group([1, 2], rid="a").seq, group([3, 4], rid="b").seq
    sched.add_request(a.group)
    sched.add_request(b.group)
    step(sched)  # both prompts, one block each; each samples a third token
    assert a.num_tokens == b.num_tokens == 3 and bm.num_free_blocks == 1
    step(sched)  # a takes the last block, b (the newest) is preempted to make room
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    assert bm.get_block_ids(b) == () and b.num_computed_tokens == 0 and b.seq_id not in bm.req_to_blocks
    assert len(bm.get_block_ids(a)) == 2 and bm.num_free_blocks == 1
