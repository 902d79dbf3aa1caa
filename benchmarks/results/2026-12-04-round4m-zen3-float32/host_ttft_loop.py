"""The TTFT loop of host_speed_0211.log: batch-1 float32 time to first token, N requests in one process,
with peer_worker.py's engine and prompts (the peers run's float32 batch-1 spec).

    PYTHONPATH=<a mmkit tree> python benchmarks/results/2026-12-04-round4m-zen3-float32/host_ttft_loop.py 7
"""
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/

import common  # noqa: E402
import peer_worker  # noqa: E402

spec = next(r["spec"] for r in json.loads((HERE / "peers_batch1.json").read_text()) if r["dtype"] == "float32")
run = peer_worker.build_engine(dict(spec, system="mmkit"))


def inputs(seed: int, n: int = 1) -> list[dict]:
    reqs = common.make_workload("uniform", n, seed=seed, uniform_len=spec["batch1_tokens"])
    return peer_worker.inputs_of(reqs, spec["image_size"])


run(inputs(999, 4), [1] * 4)  # warm-up
times = []
for rep in range(int(sys.argv[1])):
    x = inputs(500 + rep)
    start = time.perf_counter()
    run(x, [1])
    times.append(time.perf_counter() - start)
import mmkit  # noqa: E402  (which tree ran)

print(mmkit.__file__, "TTFT ms median %.1f" % (1e3 * statistics.median(times)), " ".join("%.0f" % (1e3 * t) for t in times))
