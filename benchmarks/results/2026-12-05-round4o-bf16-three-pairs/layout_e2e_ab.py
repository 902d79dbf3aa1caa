"""Round 4o: mmkit float32 throughput before and after the AVX2 panels' halves layout, end to end.

peers.py's mmkit child (peer_worker.py) on the same spec, from two checkouts: OLD (25e927a, panels
[P][K][32]) and NEW (the working tree, [P][2][K][16]), alternating OLD NEW, NEW OLD, ... per pair;
medians and per-pair ratios; the greedy ids of the 4 parity requests must be identical between
the two (the GEMM sums the same products in the same order).

    git worktree add /tmp/old 25e927a
    nice python benchmarks/results/2026-12-05-round4o-bf16-three-pairs/layout_e2e_ab.py /tmp/old . [PAIRS] [WORKLOAD ...]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # benchmarks/

import peers  # noqa: E402  (the workloads, the checkpoint, the spec)


def run(tree: Path, spec: dict) -> dict:
    """The mmkit child from `tree` (its own mmkit first on the path)."""
    return peers.run_worker(sys.executable, dict(os.environ, PYTHONPATH=str(tree)), tree, {**spec, "system": "mmkit"})


def main() -> None:
    old, new = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    workloads = sys.argv[4:] or ["decode-heavy", "prefill-heavy"]
    results = {}
    for workload in workloads:
        spec = peers.workload_spec(workload, "float32")
        runs = {"old": [], "new": []}
        for pair in range(pairs):
            for name in (["old", "new"] if pair % 2 == 0 else ["new", "old"]):
                res = run(old if name == "old" else new, spec)
                runs[name].append(res)
                print(f"[{workload} pair {pair}] {name}: {res['tok_s']:.1f} tok/s", flush=True)
        same = all(a["parity_ids"] == b["parity_ids"] for a in runs["old"] for b in runs["new"])
        o, n = [r["tok_s"] for r in runs["old"]], [r["tok_s"] for r in runs["new"]]
        results[workload] = dict(old_tok_s=o, new_tok_s=n, new_over_old_median=statistics.median(n) / statistics.median(o),
                                 per_pair=[b / a for a, b in zip(o, n)], parity_ids_identical=same)
        print(f"{workload}: old {statistics.median(o):.1f} new {statistics.median(n):.1f} tok/s, "
              f"new/old {results[workload]['new_over_old_median']:.3f} (pairs "
              f"{', '.join(f'{x:.3f}' for x in results[workload]['per_pair'])}); parity ids identical: {same}",
              flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
