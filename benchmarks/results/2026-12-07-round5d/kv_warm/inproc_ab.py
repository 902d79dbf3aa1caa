"""In-process A/B of MMKIT_KV_WARM (issue 52): one LLM, the same workload generated again and
again with the switch alternating pair by pair (the decode stack reads mmkit.envs each step), the
model runner's decode-only step time summed per run. Repeats hit the prefix cache, so after the
first (untimed) run the prefill steps are short; the decode steps are what the switch touches.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/results/2026-12-07-round5d/kv_warm/inproc_ab.py \
        --dtype bfloat16 --threads 2 --pairs 6 [--num-requests 128]
"""
import os, sys, time, statistics, argparse
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import common
p = argparse.ArgumentParser(); common.add_common_args(p)
p.add_argument("--pairs", type=int, default=6); p.add_argument("--num-requests", type=int, default=128)
p.add_argument("--workload", default="decode-heavy")
args = p.parse_args()
_, size, llm = common.setup(args)
runner = llm.llm_engine.model_runner
execute = runner.execute_model
acc = {"decode": 0.0, "prefill": 0.0}
def timed(sched):
    t = time.perf_counter(); out = execute(sched)
    n = sched.num_scheduled_tokens
    acc["decode" if sum(n.values()) == len(n) else "prefill"] += time.perf_counter() - t
    return out
runner.execute_model = timed
reqs = common.make_workload(args.workload, args.num_requests, seed=0)
inputs, params = common.mmkit_inputs(reqs, size), common.mmkit_params(reqs)
llm.generate(inputs, params, use_tqdm=False)
res = {"0": [], "1": []}
for i in range(args.pairs):
    for w in (("0", "1") if i % 2 == 0 else ("1", "0")):
        os.environ["MMKIT_KV_WARM"] = w
        acc.update(decode=0.0, prefill=0.0)
        t = time.perf_counter(); llm.generate(inputs, params, use_tqdm=False); wall = time.perf_counter() - t
        res[w].append((wall, acc["decode"], acc["prefill"]))
        print(f"pair {i} warm={w}: wall {wall:.3f} s, decode steps {acc['decode']:.3f} s, prefill steps {acc['prefill']:.3f} s", flush=True)
for w in ("0", "1"):
    print(f"warm={w}: median wall {statistics.median(r[0] for r in res[w]):.3f} s, decode {statistics.median(r[1] for r in res[w]):.3f} s")
ratios = [b[1] / a[1] for a, b in zip(res["0"], res["1"])]
print("decode-step time on/off per pair:", " ".join(f"{r:.3f}" for r in ratios), "median", f"{statistics.median(ratios):.3f}")
ratios = [b[0] / a[0] for a, b in zip(res["0"], res["1"])]
print("wall on/off per pair:", " ".join(f"{r:.3f}" for r in ratios), "median", f"{statistics.median(ratios):.3f}")
