"""The TTFT loop of host_speed_0211.log: batch-1 float32 time to first token, N requests in one process.

    PYTHONPATH=<a mmkit tree> python benchmarks/results/round4/m/host_ttft_loop.py 7
"""
import json, statistics, sys, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # benchmarks/
import common
spec = json.load(open(HERE / "peers_batch1.json"))[-1]["spec"]  # the float32 batch-1 spec
common.set_threads(2)
from mmkit import LLM, SamplingParams
import mmkit
llm = LLM(spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=128, max_model_len=2048,
          kv_cache_memory=4 << 30, kv_cache_preallocate=True)
def inputs(seed, n=1):
    reqs = common.make_workload("uniform", n, seed=seed, uniform_len=64)
    return [{"prompt_token_ids": [common.BOS_ID, common.IMAGE_ID] + r.text_ids,
             "multi_modal_data": {"image": common.make_image(r.image_seed, spec["image_size"])}} for r in reqs]
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate(inputs(999, 4), sp, use_tqdm=False)
ts = []
for rep in range(int(sys.argv[1])):
    x = inputs(500 + rep)
    t = time.perf_counter(); llm.generate(x, sp, use_tqdm=False); ts.append(time.perf_counter() - t)
print(mmkit.__file__, "TTFT ms median %.1f" % (1e3 * statistics.median(ts)), " ".join("%.0f" % (1e3 * t) for t in ts))
