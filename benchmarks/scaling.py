"""Scaling curves as PNG plots: throughput vs number of requests (mmkit and transformers),
and mmkit's p50/p99 latency vs Poisson request rate.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scaling.py --dtype bfloat16 --num-layers 4 \
        [--workload decode-heavy] [--min-requests 32] [--max-requests 1024] [--hf-batch-size 64] \
        [--rates 0.5,1,2,4,8] [--load-requests 48] [--out-dir benchmarks/results/scaling]

Throughput: for N = min, 2*min, ... up to max requests (one seeded workload per N, output
lengths forced as in throughput.py), mmkit `LLM.generate` vs transformers' `generate` in
left-padded static batches of `--hf-batch-size` (its best size at 128 requests was 64 or
all; at 1024 requests "all" would not fit the benchmark's time). Latency: `--load-requests`
requests arrive as a Poisson process at each rate into `engine.step()` (latency.py's
loop); TTFT from arrival and per-request TPOT, p50 and p99. A shallow model (`--num-layers`,
default 4) keeps the sweep to minutes on a 2-core machine; the shapes of the curves, not the
absolute numbers, are what it shows. Writes `throughput_vs_requests.png`,
`latency_vs_rate.png` and `scaling.json` into `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch)
import torch  # noqa: E402
from latency import mmkit_under_load  # noqa: E402
from throughput import time_mmkit  # noqa: E402


def request_counts(lo: int, hi: int) -> list[int]:
    if lo < 1 or hi < lo:
        raise SystemExit(f"--min-requests/--max-requests: got {lo}/{hi}; expected 1 <= min <= max")
    counts, n = [], lo
    while n <= hi:
        counts.append(n)
        n *= 2
    return counts


def plot_throughput(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    n = [r["requests"] for r in rows]
    ax.plot(n, [r["mmkit_tok_s"] for r in rows], "o-", label="mmkit (LLM.generate)")
    if any("hf_tok_s" in r for r in rows):
        ax.plot(n, [r.get("hf_tok_s", float("nan")) for r in rows], "s--", label="transformers (static batches)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("requests in one call")
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_latency(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.6), dpi=100)
    rates = [r["rate_req_s"] for r in rows]
    for ax, key, name in ((a, "ttft_s", "time to first token"), (b, "tpot_s", "time per output token")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [1e3 * r[key][q] for r in rows], style, label=q)
        ax.set_xlabel("Poisson arrival rate (requests / s)")
        ax.set_ylabel("ms")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.set_defaults(num_layers=4)
    p.add_argument("--workload", default="decode-heavy", choices=list(common.WORKLOADS))
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=1024)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="Poisson rates (requests/s) for the latency curve")
    p.add_argument("--load-requests", type=int, default=48)
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "scaling"))
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, size, llm = common.setup(args)
    hf = None if args.skip_hf else common.HFRunner(model_dir, args.dtype)
    warm = common.make_workload(args.workload, 8, seed=999, uniform_len=8, max_out=16)
    time_mmkit(llm, warm, size)
    if hf is not None:
        hf.run_static(warm, 8)
    desc = (f"{args.workload}, {args.dtype}, {args.num_layers} layers, {torch.get_num_threads()} threads"
            f"{'' if hf is None else f', transformers batch {args.hf_batch_size}'}")
    result: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "throughput": [], "latency": []}
    for i, n in enumerate(request_counts(args.min_requests, args.max_requests)):
        reqs = common.make_workload(args.workload, n, seed=1000 + i)
        useful = sum(r.max_tokens for r in reqs)
        row = {"requests": n, "mmkit_tok_s": useful / time_mmkit(llm, reqs, size)}
        if hf is not None:
            row["hf_tok_s"] = useful / hf.run_static(reqs, args.hf_batch_size)
            row["ratio"] = row["mmkit_tok_s"] / row["hf_tok_s"]
        result["throughput"].append(row)
        print(json.dumps(row), flush=True)
        plot_throughput(result["throughput"], out / "throughput_vs_requests.png", desc)
    if not args.skip_latency:
        for j, rate in enumerate(float(r) for r in args.rates.split(",") if r):
            reqs = common.make_workload(args.workload, args.load_requests, seed=5000 + j)
            row = mmkit_under_load(llm, reqs, size, rate, seed=j)
            result["latency"].append(row)
            print(json.dumps(row), flush=True)
            plot_latency(result["latency"], out / "latency_vs_rate.png",
                         f"mmkit, {args.load_requests} requests per rate, {desc.split(', transformers')[0]}")
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / "scaling.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out}/throughput_vs_requests.png, latency_vs_rate.png, scaling.json")


if __name__ == "__main__":
    main()
