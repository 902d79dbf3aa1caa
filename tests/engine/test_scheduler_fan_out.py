"""n > 1 without a model: the scheduler and the KV cache manager see n independent requests
(vLLM v1's fan-out, `engine/parent_request.py`) that share the prompt's full blocks only
through the prefix cache. Requests are added and aborted as `LLMEngine.add_processed` /
`abort_request` do; a step is driven as `LLMEngine.step` drives it (one token per sequence
whose chunk reached its end)."""

from __future__ import annotations

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager
from mmkit.engine.parent_request import ParentRequests, child_request_id, fan_out
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import SequenceGroup, SequenceStatus
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams

PROMPT = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a partial one


class Engine:
    """The engine's bookkeeping around a real Scheduler and BlockManager, minus the model."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, max_batched: int = 64,
                 prefix_caching: bool = True) -> None:
        self.bm = BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                               max_model_len=64), self.bm)
        self.parents = ParentRequests()
        self.next_token = 100

    def add(self, rid: str, n: int, prompt=PROMPT, **params) -> list[SequenceGroup]:
        processed = ProcessedPrompt(index=0, prompt=None, prompt_token_ids=list(prompt))
        children = fan_out(rid, SamplingParams(n=n, temperature=1.0, **params), [7 * i for i in range(n)])
        self.parents.add(rid, [c.request_id for c in children])
        groups = [SequenceGroup.create(c.request_id, processed, c.params, c.seed) for c in children]
        for group in groups:
            self.sched.add_request(group)
        return groups

    def abort(self, rid: str) -> None:
        for child_id in self.parents.child_ids(rid):
            self.sched.abort_request(child_id)
            self.parents.child_done(child_id)

    def step(self):
        out = self.sched.schedule()
        by_id = {g.seq.seq_id: g.seq for g in self.sched.requests.values()}
        sampled = [i for i, n in out.num_scheduled_tokens.items()
                   if by_id[i].num_computed_tokens + n == by_id[i].num_tokens]
        tokens = list(range(self.next_token, self.next_token + len(sampled)))
        self.next_token += len(sampled)
        self.sched.update_from_output(out, sampled, tokens)
        return out

    def finish(self, group: SequenceGroup) -> None:
        self.sched.finish_seq(group.seq, SequenceStatus.FINISHED_LENGTH)
        assert self.sched.remove_if_finished(group)
        self.parents.child_done(group.request_id)

    def num_unfinished(self) -> int:  # LLMEngine.get_num_unfinished_requests
        return len(self.sched.requests) - self.parents.num_extra_children


def test_fan_out_keeps_the_seeds_and_gives_prompt_logprobs_to_the_first_child():
    params = SamplingParams(n=3, seed=5, temperature=1.0, prompt_logprobs=2, max_tokens=4)
    children = fan_out("req", params, [11, 12, 13])
    assert [c.request_id for c in children] == [child_request_id("req", i) for i in range(3)] == \
        ["0_req", "1_req", "2_req"]
    assert [c.index for c in children] == [0, 1, 2] and [c.seed for c in children] == [11, 12, 13]
    assert all(c.params.n == 1 and c.params.max_tokens == 4 and c.params.seed == 5 for c in children)
    assert [c.params.prompt_logprobs for c in children] == [2, None, None]
    alone = fan_out("one", SamplingParams(seed=5), [9])
    assert len(alone) == 1 and alone[0].request_id == "one" and alone[0].params.n == 1 and alone[0].seed == 9


def test_children_are_admitted_together_and_share_the_full_prompt_blocks():
    engine = Engine(num_blocks=16)
    bm = engine.bm
    groups = engine.add("r", n=3)
    assert [g.request_id for g in groups] == ["0_r", "1_r", "2_r"]
    assert [s.group.request_id for s in engine.sched.waiting] == ["0_r", "1_r", "2_r"]
    out = engine.step()
    # The first child computes the prompt; its full blocks are published as the step is
    # scheduled, so its siblings in the same step hit them and compute only the partial block.
    assert [d.request_id for d in out.new_seqs] == ["0_r", "1_r", "2_r"]
    assert [d.num_computed_tokens for d in out.new_seqs] == [0, 8, 8]
    assert list(out.num_scheduled_tokens.values()) == [10, 2, 2]
    tables = [bm.get_block_ids(g.seq) for g in groups]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert all(bm.ref_counts[b] == 3 for b in tables[0][:2]) and all(bm.ref_counts[t[2]] == 1 for t in tables)
    assert bm.num_free_blocks == 16 - 2 - 3  # the full blocks once, one partial block per child
    assert bm.num_cache_hits == 16 and out.new_seqs[1].block_ids[:2] == tables[0][:2]
    assert [g.seq.output_token_ids for g in groups] == [[100], [101], [102]]
    assert all(g.seq.status is SequenceStatus.RUNNING for g in groups)
    assert engine.num_unfinished() == 1 and len(engine.sched.requests) == 3
    for _ in range(3):  # each child writes its own partial block: nothing shared is written
        engine.step()
    tables = [bm.get_block_ids(g.seq) for g in groups]
    assert all(bm.ref_counts[b] == 3 for b in tables[0][:2]) and all(len(t) == 4 for t in tables)
    for group in groups:
        engine.finish(group)
    assert bm.req_to_blocks == {} and bm.num_free_blocks == 16 and not any(bm.ref_counts)
    assert engine.num_unfinished() == 0 and len(engine.parents) == 0 and engine.parents.num_extra_children == 0


def test_without_prefix_caching_each_child_computes_its_prompt():
    engine = Engine(num_blocks=16, prefix_caching=False)
    groups = engine.add("r", n=2)
    out = engine.step()
    assert list(out.num_scheduled_tokens.values()) == [10, 10] and engine.bm.num_free_blocks == 16 - 6
    assert not set(engine.bm.get_block_ids(groups[0].seq)) & set(engine.bm.get_block_ids(groups[1].seq))


def test_preempting_one_child_leaves_its_siblings_and_it_resumes_from_the_cache():
    # 6 blocks: the prompt's 2 shared blocks + 3 partial ones + 1 free; at position 12 every
    # child needs one more block, so the newest child is preempted while the others go on.
    engine = Engine(num_blocks=6)
    bm = engine.bm
    groups = engine.add("r", n=3)
    engine.step()
    assert bm.num_free_blocks == 1
    engine.step()  # tokens 11 and 12 fit the partial blocks
    engine.step()
    out = engine.step()  # position 12: the first child takes the last free block, the newest is preempted
    assert engine.sched.num_preemptions >= 1
    victim = groups[2].seq
    assert victim.status is SequenceStatus.WAITING and bm.get_block_ids(victim) == ()
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens == 3
    assert groups[0].seq.status is SequenceStatus.RUNNING and groups[0].seq.seq_id in out.num_scheduled_tokens
    assert all(bm.ref_counts[b] >= 1 for b in bm.get_block_ids(groups[0].seq)[:2])
    engine.finish(groups[0])
    engine.finish(groups[1])
    out = engine.step()  # resumed: its prompt's full blocks are still cached
    assert [d.request_id for d in out.new_seqs] == ["2_r"] and out.new_seqs[0].num_computed_tokens == 8
    assert out.new_seqs[0].token_ids[:10] == tuple(PROMPT) and len(out.new_seqs[0].token_ids) == 13
    engine.finish(groups[2])
    assert bm.req_to_blocks == {} and bm.num_free_blocks == 6 and not any(bm.ref_counts)
    assert engine.num_unfinished() == 0


def test_aborting_the_parent_aborts_every_child_running_or_waiting():
    engine = Engine(num_blocks=16, max_num_seqs=2)
    groups = engine.add("r", n=3)
    other = engine.add("x", n=1)[0]
    assert other.request_id == "x" and engine.num_unfinished() == 2
    engine.step()  # two children run; the third child and "x" wait (max_num_seqs=2)
    assert [g.seq.status for g in groups] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]
    seq_ids = {g.seq.seq_id for g in groups}
    engine.abort("r")
    assert all(g.seq.status is SequenceStatus.FINISHED_ABORTED for g in groups)
    assert set(engine.sched.requests) == {"x"} and engine.num_unfinished() == 1 and "r" not in engine.parents
    out = engine.step()
    assert seq_ids <= out.finished_seq_ids  # the runner drops the states it holds
    assert other.seq.seq_id in out.num_scheduled_tokens
    engine.finish(other)
    assert engine.bm.req_to_blocks == {} and engine.bm.num_free_blocks == 16 and engine.num_unfinished() == 0


def test_abort_before_any_child_ran():
    engine = Engine(num_blocks=4)
    groups = engine.add("r", n=4, prompt=[1, 2, 3])
    engine.abort("r")
    assert engine.sched.requests == {} and engine.num_unfinished() == 0
    assert all(g.seq.status is SequenceStatus.FINISHED_ABORTED for g in groups)
    out = engine.step()
    assert out.is_empty and engine.bm.num_free_blocks == 4


def test_parent_registry_counts_user_requests():
    parents = ParentRequests()
    parents.add("a", ["a"])  # n = 1: nothing to record
    parents.add("b", ["0_b", "1_b", "2_b"])
    assert "a" not in parents and "b" in parents and len(parents) == 1
    assert parents.child_ids("a") == ("a",) and parents.child_ids("b") == ("0_b", "1_b", "2_b")
    assert parents.parent_id("1_b") == "b" and parents.parent_id("a") == "a"
    assert parents.num_extra_children == 2
    parents.child_done("1_b")
    parents.child_done("1_b")  # twice: no effect
    assert parents.num_extra_children == 1 and "b" in parents
    parents.child_done("0_b")
    parents.child_done("2_b")
    assert parents.num_extra_children == 0 and "b" not in parents and parents.child_ids("b") == ("b",)
