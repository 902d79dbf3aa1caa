"""Per-step cost of the engine's bookkeeping alone, no model: `Scheduler.schedule()` (block
manager, prefix-cache registration), the runner's state update and batch preparation (decode
block tables -> attention metadata) and `Scheduler.update_from_output`.

    python benchmarks/step_time.py [--batch 256] [--contexts 1024,4096,8192] [--steps 32]

`batch` sequences are prefilled to each context length in one step (not timed), then decode
steps are timed one by one; the median is printed per context. The work of a step should not
grow with the context: a sequence gains a block every `block_size` steps whatever its length.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch

from mmkit.config import SchedulerConfig
from mmkit.engine.block_manager import BlockManager, blocks_needed
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import SequenceGroup
from mmkit.processors.base import ProcessedPrompt
from mmkit.sampling_params import SamplingParams
from mmkit.worker.model_runner import ModelRunner
from mmkit.worker.seq_state import Chunk


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def bare_runner(block_size: int) -> ModelRunner:
    """A `ModelRunner` without a model: only its per-sequence cache and batch preparation."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.block_size = block_size
    runner.states = {}
    runner._fork_generators = {}
    runner.sampler_hooks = []
    runner.state_cache = None  # no hybrid decoder's state
    runner.lora_manager = None
    runner.attention_backend = "torch"  # the CPU kernels: no per-step backend metadata
    runner.num_cache_blocks = 0
    init = getattr(runner, "_init_batch_state", None)
    if init is not None:  # the persistent block tables (absent before they existed)
        init()
    return runner


def measure(batch: int, context: int, steps: int, block_size: int, prefix_caching: bool) -> tuple[float, float]:
    """Median (wall, CPU) seconds per decode step of `batch` sequences holding `context` tokens."""
    num_blocks = batch * (blocks_needed(context + steps + 2, block_size) + 1)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * context,
                             max_model_len=context + steps + 2)
    sched = Scheduler(config, bm)
    runner = bare_runner(block_size)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2)
    for i in range(batch):
        # The first token differs per sequence: no prefix is shared (nothing is a cache hit).
        ids = [1000 + i] + [(i + j) % 200 for j in range(context - 1)]
        group = SequenceGroup.create(f"r{i}", ProcessedPrompt(i, None, ids), params, i)
        sched.add_request(group)

    def step() -> None:
        out = sched.schedule()
        runner._update_states(out)
        chunks = []
        for seq_id, num_new in out.num_scheduled_tokens.items():
            state = runner.states[seq_id]
            chunks.append(Chunk(state, state.num_computed_tokens, state.num_computed_tokens + num_new))
        if all(c.num_new_tokens == 1 for c in chunks):  # the prefill step is not prepared
            runner._prepare(chunks)
        for c in chunks:
            c.state.num_computed_tokens = c.end
            c.state.token_ids.append(7)  # the runner appends what it samples
        seq_ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, seq_ids, [7] * len(seq_ids))

    step()  # the prefill of every prompt
    walls, cpus = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - start_cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated tokens of context")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--repeats", type=int, default=3, help="runs per context; the lowest medians are kept")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"CPU: {cpu_model()}")
    print(f"batch {args.batch}, block_size {args.block_size}, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}, median of {args.steps} decode steps, "
          f"best of {args.repeats} runs (wall; and the thread's CPU time, which a busy host inflates less)")
    print(f"{'context':>8} | {'ms/step':>8} | {'cpu ms':>8}")
    print(f"{'-' * 8}-+-{'-' * 8}-+-{'-' * 8}")
    for context in contexts:
        runs = [measure(args.batch, context, args.steps, args.block_size, not args.no_prefix_caching)
                for _ in range(args.repeats)]
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{context:>8} | {wall * 1e3:>8.3f} | {cpu * 1e3:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
