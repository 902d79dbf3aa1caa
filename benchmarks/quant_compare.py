"""bf16 vs online int8 / int4 weights, each in its own process, alternating, median of runs.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/quant_compare.py [--runs 3] [--out benchmarks/results/<YYYY-MM-DD>-<topic>]

Batch 1: `latency.py --skip-hf --skip-load` (time per output token, p50, wall and this process's
CPU time, and peak RSS) for
bf16, int8, int4; decode-heavy throughput: `throughput.py --workload decode-heavy --skip-hf`
(128 requests) for bf16 and int8. Runs alternate modes so slow drifts of a shared machine hit
every mode alike; the ratios are of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, *cmd, "--json", str(out)], check=True, cwd=HERE.parent)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "quant_compare"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = {"bf16": [], "int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"]}
    tpot: dict[str, list[float]] = {m: [] for m in modes}
    tpot_cpu: dict[str, list[float]] = {m: [] for m in modes}
    tput_rss: dict[str, list[float]] = {"bf16": [], "int8": []}
    rss: dict[str, list[float]] = {m: [] for m in modes}
    weights: dict[str, dict] = {}
    tput: dict[str, list[float]] = {"bf16": [], "int8": []}
    for r in range(args.runs):
        for mode, flags in modes.items():
            res = run([str(HERE / "latency.py"), "--dtype", "bfloat16", "--threads", "2", "--skip-hf", "--skip-load",
                       "--batch1-requests", "3", "--output-len", str(args.output_len), *flags],
                      out / f"latency_{mode}_{r}.json")
            tpot[mode].append(res["mmkit_batch1"]["tpot_s"]["p50"])
            tpot_cpu[mode].append(res["mmkit_batch1"].get("tpot_cpu_s", {}).get("p50"))
            rss[mode].append(res["peak_rss_mb"])
            weights[mode] = res["weights"]
        if not args.skip_throughput:
            for mode in tput:
                res = run([str(HERE / "throughput.py"), "--dtype", "bfloat16", "--threads", "2", "--skip-hf",
                           "--workload", "decode-heavy", "--num-requests", "128", "--repeats", "1", *modes[mode]],
                          out / f"throughput_{mode}_{r}.json")
                tput[mode].append(res["mmkit_tok_s"])
                tput_rss[mode].append(res["peak_rss_mb"])
    med = {m: statistics.median(v) for m, v in tpot.items()}
    summary = {"runs": args.runs, "tpot_p50_s": tpot, "tpot_median_s": med, "peak_rss_mb": rss, "weights": weights,
               "tpot_ratio_int8": med["int8"] / med["bf16"], "tpot_ratio_int4": med["int4"] / med["bf16"]}
    if all(v is not None for vals in tpot_cpu.values() for v in vals):
        cpu_med = {m: statistics.median(v) for m, v in tpot_cpu.items()}
        summary.update({"tpot_cpu_p50_s": tpot_cpu, "tpot_cpu_median_s": cpu_med,
                        "tpot_cpu_ratio_int8": cpu_med["int8"] / cpu_med["bf16"],
                        "tpot_cpu_ratio_int4": cpu_med["int4"] / cpu_med["bf16"]})
    if tput["bf16"]:
        summary["throughput_tok_s"] = tput
        summary["throughput_peak_rss_mb"] = tput_rss
        summary["throughput_ratio_int8"] = statistics.median(tput["int8"]) / statistics.median(tput["bf16"])
    (out / "quant_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
