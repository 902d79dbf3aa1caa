"""Round 4i evidence: decode-heavy bf16 throughput, minor faults and sys time over the timed
`generate` only; MO=1 applies mallopt before torch loads; --perf FILE records perf over it.
Run from the repository root: python benchmarks/results/2026-12-03-round4i-byte-floor/decode_heavy_faults.py [--perf F]"""
import sys, os, time, subprocess, signal, gc, ctypes
if os.environ.get("MO"):
    libc = ctypes.CDLL("libc.so.6"); print("mallopt", libc.mallopt(-3, 32 << 20), libc.mallopt(-1, 1 << 30), libc.mallopt(-2, 64 << 20))
sys.path.insert(0, "benchmarks")
import common, torch, argparse
p = argparse.ArgumentParser(); common.add_common_args(p); p.add_argument("--workload", default="decode-heavy"); p.add_argument("--perf", default="")
args = p.parse_args()
_, size, llm = common.setup(args)
reqs = common.make_workload(args.workload, 128, seed=0)
inps, params = common.mmkit_inputs(reqs, size), common.mmkit_params(reqs)
llm.generate(inps[:8], params[:8], use_tqdm=False)
prof = subprocess.Popen(["perf", "record", "-F", "999", "-e", "cpu-clock", "-o", args.perf, "-p", str(os.getpid())]) if args.perf else None
time.sleep(0.5)
import resource; r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter(); outs = llm.generate(inps, params, use_tqdm=False); w = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF); print(f'minflt {r1.ru_minflt - r0.ru_minflt} cpu {r1.ru_utime - r0.ru_utime:.2f} user {r1.ru_stime - r0.ru_stime:.2f} sys maxrss {r1.ru_maxrss/1024:.0f} MB')
if prof: prof.send_signal(signal.SIGINT); prof.wait()
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"{n} tokens in {w:.2f} s: {n/w:.1f} tok/s; gc counts {gc.get_count()} stats {[s['collections'] for s in gc.get_stats()]}")
