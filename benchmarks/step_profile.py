"""Per-op time of one decode step (batch 1 and a larger batch) and of one prefill step.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/step_profile.py --dtype bfloat16 [--quantization int8] \
        [--batch 1 128] [--steps 5] [--num-layers 30] [--json out.json]

The decoder's modules (fused qkv / o / gate_up / down projections, attention, norms, the LM
head) are wrapped in `torch.profiler.record_function` so that C kernels called through ctypes
(which the profiler cannot see) are attributed to the module that called them. The figures
are self CPU time per step (ms), averaged over `--steps` steps; the step's wall time is
measured separately without the profiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402


def label_modules(model: torch.nn.Module) -> None:
    """Wrap each decoder submodule's forward in a profiler range named by its role."""
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.isdigit() or not name or mod is model:
            continue
        if leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm",
                    "post_attention_layernorm", "norm", "lm_head", "embed_tokens") or leaf == "self_attn" \
                or leaf == "mlp":
            role = f"mod::{leaf}"
            fwd = mod.forward

            def wrapped(*a, _fwd=fwd, _role=role, **kw):
                with record_function(_role):
                    return _fwd(*a, **kw)

            mod.forward = wrapped


def decode_steps(llm, batch: int, size: int, steps: int, prof_steps: int):
    """Admit `batch` requests, run until all are decoding, then time `steps` steps and profile
    `prof_steps` more. Returns (wall ms per step list, profiler key averages)."""
    engine = llm.llm_engine
    reqs = common.make_workload("uniform", batch, seed=7, uniform_len=steps + prof_steps + 64)
    for i, (inp, params) in enumerate(zip(common.mmkit_inputs(reqs, size), common.mmkit_params(reqs))):
        engine.add_request(f"p-{batch}-{i}-{time.monotonic_ns()}", inp, params)
    # prefill everything (chunks) until every sequence has a token
    for _ in range(200):
        engine.step()
        if all(len(s.output_token_ids) > 0 for s in _seqs(engine)) and len(_seqs(engine)) == batch:
            break
    for _ in range(2):
        engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(prof_steps):
            engine.step()
    engine.abort_request([r for r in list(_request_ids(engine))])
    while engine.has_unfinished_requests():
        engine.step()
    return walls, prof


def _seqs(engine):
    return list(engine.scheduler.running)


def _request_ids(engine):
    return {s.group.request_id for s in list(engine.scheduler.running) + list(engine.scheduler.waiting)}


def prefill_step(llm, size: int, prof_steps: int):
    engine = llm.llm_engine
    walls = []
    profs = None
    for k in range(prof_steps + 1):
        reqs = common.make_workload("uniform", 1, seed=100 + k, uniform_len=1)
        inp, params = common.mmkit_inputs(reqs, size)[0], common.mmkit_params(reqs)[0]
        engine.add_request(f"pf-{k}-{time.monotonic_ns()}", inp, params)
        if k == prof_steps:
            with profile(activities=[ProfilerActivity.CPU]) as profs:
                engine.step()
        else:
            t0 = time.perf_counter()
            engine.step()
            walls.append(1e3 * (time.perf_counter() - t0))
        while engine.has_unfinished_requests():
            engine.step()
    return walls, profs


def table(prof, steps: int, top: int = 25) -> list[tuple[str, float, int]]:
    rows = []
    for ev in prof.key_averages():
        rows.append((ev.key, ev.self_cpu_time_total / 1e3 / steps, ev.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prefill", action="store_true", help="also profile one prefill step (196 image tokens)")
    args = p.parse_args()
    model_dir, size, llm = common.setup(args)
    label_modules(llm.llm_engine.model_runner.model)
    result = {"args": vars(args), "decode": {}, "prefill": None}
    for b in args.batch:
        walls, prof = decode_steps(llm, b, size, args.steps, 3)
        rows = table(prof, 3)
        result["decode"][b] = {"wall_ms_median": statistics.median(walls), "wall_ms": walls, "ops": rows}
        print(f"\n== decode batch {b}: wall {statistics.median(walls):.2f} ms/step (median of {len(walls)})")
        for k, ms, c in rows:
            print(f"  {ms:8.3f} ms  x{c:<5d} {k}")
    if args.prefill:
        walls, prof = prefill_step(llm, size, 2)
        rows = table(prof, 1)
        result["prefill"] = {"wall_ms": walls, "ops": rows}
        print(f"\n== prefill step (1 request): wall {walls} ms")
        for k, ms, c in rows:
            print(f"  {ms:8.3f} ms  x{c:<5d} {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
