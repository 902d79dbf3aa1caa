"""Scheduler + block manager time per decode step, without a model (issue 23's before/after of
the code it changed: block tables in the block manager, forks in SequenceGroup).

    PYTHONPATH=<tree> python seam_sched_overhead.py   # prints microseconds per step (median of 5)

32 requests (n=1 and n=4 mixed, prefix caching on), a 96-token prompt each, decoded 300 steps;
each step is schedule() + update_from_output() as LLMEngine.step drives them. Works with the
tree before the change (Sequence.block_table) and after (BlockManager.req_to_blocks).
"""

import statistics
import time

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import Sequence, SequenceGroup
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams


def make_group(rid: str, ids: list[int], n: int) -> SequenceGroup:
    group = SequenceGroup(request_id=rid, processed=ProcessedPrompt(index=0, prompt=None, prompt_token_ids=ids),
                          params=SamplingParams(n=n, temperature=1.0, max_tokens=1000))
    seqs = [Sequence(group=group, index=i, token_ids=list(ids), num_prompt_tokens=len(ids), seed=i) for i in range(n)]
    group.seqs, group.pending_forks = seqs[:1], seqs[1:]
    seqs[0].num_pending_forks = n - 1
    return group


def run_once(num_steps: int = 300) -> float:
    bm = BlockManager(4096, 16, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=4096), bm)
    groups = [make_group(f"r{i}", [i % 7] * 32 + list(range(i, i + 64)), 4 if i % 4 == 0 else 1) for i in range(32)]
    for g in groups:
        sched.add_request(g)
    token = 0
    start = time.perf_counter()
    for _ in range(num_steps):
        out = sched.schedule()
        by_id = {s.seq_id: s for g in groups for s in g.seqs}
        sampled = [i for i, k in out.num_scheduled_tokens.items() if by_id[i].num_computed_tokens + k == by_id[i].num_tokens]
        counts = [1 + by_id[i].num_pending_forks for i in sampled]
        sched.update_from_output(out, sampled, counts, list(range(token, token + sum(counts))))
        token += sum(counts)
    return (time.perf_counter() - start) / num_steps * 1e6


if __name__ == "__main__":
    run_once(20)  # warm-up
    print(f"{statistics.median(run_once() for _ in range(5)):.1f}")
