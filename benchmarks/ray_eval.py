"""`mmkit eval` single-process vs `mmkit eval --ray --concurrency N` on the same data set.

Runs both as the user would (fresh processes, the embedded model unless --model), each into a
fresh results file, and prints end-to-end items/s (process start to exit: Ray's start, actor
start-up and model loads included) and the evaluation phase's items/s (the summary's
`seconds`: single-process after the model is loaded; Ray from submitting the dataset to the
last answer, so the actors' start-up is inside it). `--repeat K` runs the data set K times
over (as K x more items) to show how the fixed start-up cost amortizes.

    nice python benchmarks/ray_eval.py assets/eval/quickstart.jsonl --concurrency 2 --repeat 1 10
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeat", type=int, nargs="+", default=[1])
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
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
            for mode, extra in (("single", []), (f"ray x{args.concurrency}", ["--ray", "--concurrency",
                                                                              str(args.concurrency)])):
                wall, summary = run(["eval", str(big), "--output", str(Path(tmp) / f"{mode[:3]}_{k}.jsonl"),
                                     *common, *extra])
                n = summary["num_items"]
                row = {"items": n, "mode": mode, "wall_s": round(wall, 1), "e2e_items_s": round(n / wall, 2),
                       "phase_s": round(summary["seconds"], 1),
                       "phase_items_s": round(n / summary["seconds"], 2), "accuracy": summary["accuracy"],
                       "throughput_line": summary["throughput_line"]}
                figures.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n| items | mode | wall s | items/s (end to end) | eval phase s | items/s (phase) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in figures:
        print(f"| {r['items']} | {r['mode']} | {r['wall_s']} | {r['e2e_items_s']} | {r['phase_s']} | "
              f"{r['phase_items_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
