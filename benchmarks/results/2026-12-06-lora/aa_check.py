import sys, time
sys.path.insert(0, "/work/wt/i49/benchmarks")
import common
from common import make_workload, mmkit_inputs, mmkit_params, build_model, set_threads
set_threads(1)
from transformers import AutoConfig
from mmkit import LLM
model_dir = build_model(30, 96)
text = AutoConfig.from_pretrained(model_dir).get_text_config()
kv = dict(kv_cache_memory=256 << 20)
engines = {"lora0": LLM(model_dir, dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=8, **kv).llm_engine,
           "base1": LLM(model_dir, dtype="bfloat16", **kv).llm_engine,
           "lora1": LLM(model_dir, dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=8, **kv).llm_engine,
           "base2": LLM(model_dir, dtype="bfloat16", **kv).llm_engine}
for rep in range(2):
    reqs = make_workload("decode-heavy", 16, seed=rep, vocab_size=text.vocab_size, max_out=64)
    for name, e in engines.items():
        for i, (inp, p) in enumerate(zip(mmkit_inputs(reqs, 96), mmkit_params(reqs))):
            e.add_request(f"{rep}-{i}", inp, p)
    secs = dict.fromkeys(engines, 0.0)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, e in engines.items():
            if e.has_unfinished_requests():
                t = time.perf_counter(); e.step(); secs[name] += time.perf_counter() - t
    print(rep, {k: round(v, 2) for k, v in secs.items()}, flush=True)
