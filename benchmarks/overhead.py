"""Time outside the model forward at a steady decode batch (default 32 sequences).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/overhead.py --dtype bfloat16 [--batch 32] [--num-layers 30]

Drives `LLMEngine.step()` directly. The model's own work (token embedding, vision tower,
decoder forward, LM head) is timed by wrapping the model's methods; everything else in a step
(scheduling, batch preparation, sampling, post-processing, detokenization, output building)
is overhead. Only pure decode steps after every prompt is prefilled are counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402


class ForwardTimer:
    """Wraps the model's compute methods and sums their wall time."""

    METHODS = ("embed_tokens", "encode_images", "forward", "compute_logits")

    def __init__(self, model) -> None:
        self.total = 0.0
        for name in self.METHODS:
            setattr(model, name, self._wrap(getattr(model, name)))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
        return timed


def measure(llm, batch: int, steps: int, image_size: int, seed: int = 7) -> dict:
    engine = llm.llm_engine
    reqs = common.make_workload("uniform", batch, seed=seed, uniform_len=steps + 8)
    for i, (inp, params) in enumerate(zip(common.mmkit_inputs(reqs, image_size), common.mmkit_params(reqs))):
        engine.add_request(f"ovh-{seed}-{i}", inp, params)
    timer = ForwardTimer(engine.model_runner.model)
    step_times, fwd_times = [], []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        pure_decode = (not engine.scheduler.waiting and len(running) == batch
                       and all(s.num_tokens - s.num_computed_tokens == 1 for s in running))
        before = timer.total
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if pure_decode and len(step_times) < steps:
            step_times.append(elapsed)
            fwd_times.append(timer.total - before)
    step, fwd = sum(step_times), sum(fwd_times)
    return {"batch": batch, "decode_steps": len(step_times), "step_ms": 1e3 * step / len(step_times),
            "forward_ms": 1e3 * fwd / len(step_times), "overhead_fraction": (step - fwd) / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    _, size, llm = common.setup(args)
    measure(llm, 4, 4, size, seed=99)  # warm-up
    runs = [measure(llm, args.batch, args.steps, size, seed=r) for r in range(args.repeats)]
    runs.sort(key=lambda r: r["overhead_fraction"])
    med = runs[len(runs) // 2]
    print(f"{args.dtype}, batch {args.batch}, {args.num_layers} layers, {torch.get_num_threads()} threads: "
          f"step {med['step_ms']:.1f} ms, forward {med['forward_ms']:.1f} ms, "
          f"outside the forward {med['overhead_fraction']:.1%} (median of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "median": med, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
