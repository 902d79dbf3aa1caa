"""Worker processes' start time and memory (the README's "about 270 MB private" figure).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/results/2026-12-06-preprocess-pool/worker_memory.py

Builds `benchmarks/preprocess.py`'s checkpoint in a temporary folder, then an engine with the
default threads and one with `mm_processor_workers=2`; prints each worker's /proc status and
smaps_rollup lines after start and after four 1024x768 photos.
"""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common, preprocess
common.set_threads(2)
from mmkit import LLM, SamplingParams
if __name__ == "__main__":
    path = preprocess.build_checkpoint(Path(tempfile.mkdtemp()) / "qwen2-vl", 200704)
    t = time.perf_counter(); a = LLM(str(path), dtype="float32", max_model_len=2048); ta = time.perf_counter() - t
    t = time.perf_counter(); b = LLM(str(path), dtype="float32", max_model_len=2048, mm_processor_workers=2); tb = time.perf_counter() - t
    pool = b.llm_engine.prefetcher.processes
    t = time.perf_counter(); pool._executor.submit(int).result(); tw = time.perf_counter() - t
    for pid in pool.pids():
        print('after start', pid, [l for l in open(f'/proc/{pid}/status') if l.startswith(('VmRSS','RssAnon','RssFile','RssShmem'))])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    preprocess.run_once(b, preprocess.photos(4, 1), params)
    for pid in pool.pids():
        print('after 4 images', pid, [l.strip() for l in open(f'/proc/{pid}/smaps_rollup') if l.startswith(('Rss','Pss:','Private_Dirty','Shared_Clean', 'Shared_Dirty'))])
    print(f"LLM() threads: {ta:.1f} s; LLM() with 2 worker processes: {tb:.1f} s, then workers ready after {tw:.1f} s more")
