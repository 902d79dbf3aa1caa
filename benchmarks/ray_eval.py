"""`mmkit eval` single-process vs `mmkit eval --ray --concurrency N` on the same data set.

Runs both as the user would (fresh processes, the embedded model unless --model), each into a
fresh results file, and prints end-to-end items/s (process start to exit: Ray's start, actor
start-up and model loads included) and the evaluation phase's items/s (the summary's
`seconds`: single-process after the model is loaded; Ray from submitting the dataset to the
last answer, so the actors' start-up is inside it). `--repeat K` runs the data set K times
over (as K x more items) to show how the fixed start-up cost amortizes. `--runs R` runs each
mode R times (alternating) and reports the median. Each data size also gets a "Ray alone" row:
a fresh process that starts Ray, pushes the same number of rows through the same Ray Data
pipeline shape with do-nothing actors, and shuts Ray down: the part of the overhead that is
Ray's own, whatever mmkit does.

    nice python benchmarks/ray_eval.py assets/eval/quickstart.jsonl --concurrency 2 --repeat 1 10 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args: list[str]) -> tuple[float, dict]:
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mmkit", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"mmkit {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    output = args[args.index("--output") + 1]
    summary = json.loads(Path(output).with_name(Path(output).stem + ".summary.json").read_text())
    throughput = [line for line in out.stdout.splitlines() if line.startswith("throughput:")]
    summary["throughput_line"] = throughput[0] if throughput else None
    return wall, summary


_FLOOR = """
import sys, time
start = time.perf_counter()
import ray, ray.data
ray.init(address="local", num_cpus=3, include_dashboard=False)
init = time.perf_counter()

class Noop:
    def __call__(self, batch):
        return batch

rows = ray.data.from_items([{"i": i} for i in range(int(sys.argv[1]))])
n = rows.map_batches(Noop, batch_size=16, compute=ray.data.ActorPoolStrategy(size=int(sys.argv[2]))).count()
run = time.perf_counter()
ray.shutdown()
print(f"{init - start:.2f} {run - init:.2f} {time.perf_counter() - run:.2f}")
"""


def ray_floor(items: int, concurrency: int) -> dict:
    """What Ray itself costs a process, with no model: start, the same Ray Data pipeline shape
    through `concurrency` do-nothing actors, shutdown (a fresh process, as the real run)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _FLOOR, str(items), str(concurrency)], capture_output=True,
                         text=True, env=dict(os.environ, RAY_ADDRESS=""))
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"ray floor failed:\n{out.stderr[-4000:]}")
    init, run, shutdown = map(float, out.stdout.split()[-3:])
    return {"items": items, "mode": f"Ray alone, {concurrency} no-op actors", "wall_s": round(wall, 1),
            "init_s": init, "pipeline_s": run, "shutdown_s": shutdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeat", type=int, nargs="+", default=[1])
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--runs", type=int, default=1, help="runs of each mode (the median wall time is reported)")
    args = parser.parse_args()
    data = Path(args.data).resolve()
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.repeat:
            big = Path(tmp) / f"data_x{k}.jsonl"
            big.write_text("".join(json.dumps(dict(r, image=str(data.parent / r["image"]))) + "\n"
                                   for _ in range(k) for r in rows))
            common = ["--no-progress"] + (["--model", args.model] if args.model else [])
            modes = (("single", []), (f"ray x{args.concurrency}", ["--ray", "--concurrency", str(args.concurrency)]))
            runs: dict[str, list] = {mode: [] for mode, _ in modes}
            floors = []
            for r in range(args.runs):  # the modes alternate, so drift in the machine's load hits both
                for mode, extra in modes:
                    out = Path(tmp) / f"{mode[:3]}_{k}_{r}.jsonl"
                    runs[mode].append(run(["eval", str(big), "--output", str(out), *common, *extra]))
                floors.append(ray_floor(k * len(rows), args.concurrency))
            for mode, _ in modes:
                walls = [w for w, _ in runs[mode]]
                wall, summary = sorted(runs[mode], key=lambda x: x[0])[len(walls) // 2]  # the median run
                n = summary["num_items"]
                row = {"items": n, "mode": mode, "wall_s": round(wall, 1), "wall_runs_s": [round(w, 1) for w in walls],
                       "e2e_items_s": round(n / wall, 2), "phase_s": round(summary["seconds"], 1),
                       "phase_items_s": round(n / summary["seconds"], 2), "accuracy": summary["accuracy"],
                       "throughput_line": summary["throughput_line"]}
                figures.append(row)
                print(json.dumps(row), flush=True)
            single, ray_run = figures[-2]["wall_s"], figures[-1]["wall_s"]
            floor = sorted(floors, key=lambda f: f["wall_s"])[len(floors) // 2]
            floor["overhead_share"] = round((ray_run - single) / ray_run, 3)
            floor["ray_alone_share"] = round(floor["wall_s"] / (single + floor["wall_s"]), 3)
            figures.append(floor)
            print(json.dumps(floor), flush=True)
    print("\n| items | mode | wall s (median) | runs | items/s (end to end) | eval phase s | items/s (phase) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in figures:
        if "init_s" in r:
            print(f"| {r['items']} | {r['mode']}: init {r['init_s']} s, pipeline {r['pipeline_s']} s, shutdown "
                  f"{r['shutdown_s']} s | {r['wall_s']} | | | | |")
            print(f"| | Ray path's overhead share of its run: {r['overhead_share']:.0%}; Ray alone, added to the "
                  f"single-process run, would be {r['ray_alone_share']:.0%} of it | | | | | |")
        else:
            print(f"| {r['items']} | {r['mode']} | {r['wall_s']} | {r['wall_runs_s']} | {r['e2e_items_s']} | "
                  f"{r['phase_s']} | {r['phase_items_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
