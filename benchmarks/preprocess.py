"""Preprocessing-heavy workload: where the HF processor's work runs (serial, threads, processes).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/preprocess.py --num-requests 32 --repeats 3 \\
        --json preprocess.json

N requests, each one distinct 1024x768 photo (a crop of `assets/photos`, as `--large-images`)
and a short question, greedy, `--max-tokens` tokens, through `LLM.generate` on a tiny random
Qwen2-VL whose image processor has the real checkpoints' settings (patch 14, merge 2,
max_pixels 28*28*1280: a 1024x768 photo is 3996 patches, 999 image tokens, 18.8 MB of float32
pixel patches). The model is tiny on purpose, so the processor's work weighs as much as it can;
even so, at the real max_pixels the tiny vision tower's attention over 3996 patches is most of
each request (the serial run reports the processor's share); `--max-pixels 200704` (a common
serving cap) makes the tower ~14x cheaper and the processor a larger share.

Three engines in one process, the same settings but where the processor runs:
- `serial`: `async_preprocess=False`, every item's processor work on the calling thread;
- `threads`: the default, two worker threads of the engine's process (`mm_processor_workers=0`);
- `processes`: `mm_processor_workers=--workers` worker processes.
Each repeat runs all three in a rotated order on its own photos (no cache hits); the greedy ids
must be identical across the three. Reports seconds per call, requests/s and each mode's speedup
over serial, median of `--repeats`.

`--micro` adds the processor alone on the same photos (no engine): per-image milliseconds
serially, on 1 and 2 threads and on 2 processes (including the transfer of its result), and
the share of the processor's time that holds the GIL, read from how much a pure-Python spinner
thread slows beside it (1 - its rate beside the processor / its rate alone, on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

QUESTION = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the image?<|im_end|>\n"
            "<|im_start|>assistant\n")
MODES = ("serial", "threads", "processes")


def build_checkpoint(folder: Path, max_pixels: int = 28 * 28 * 1280) -> Path:
    from mmkit.testing.qwen2_vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(folder, seed=0, patch_size=14, min_pixels=56 * 56, max_pixels=max_pixels,
                               max_position_embeddings=4096)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    return f"{name} (family {fields.get('CPU family', '?').strip()}, model {fields.get('Model', '?').strip()}), " \
           f"{os.cpu_count()} CPUs"


def photos(n: int, first_seed: int) -> list:
    common.LARGE_IMAGES = True
    return [common.make_image(seed, 0) for seed in range(first_seed, first_seed + n)]


def run_once(llm, images: list, params) -> tuple[float, list]:
    inputs = [{"prompt": QUESTION, "multi_modal_data": {"image": img}} for img in images]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def _time_processor(llm) -> list[float]:
    """Wraps the serial engine's `mm_item_inputs`: the returned [seconds] sums its time."""
    processor = llm.llm_engine.input_stage.input_processor
    original = processor.mm_item_inputs
    total = [0.0]

    def timed(item):
        start = time.perf_counter()
        try:
            return original(item)
        finally:
            total[0] += time.perf_counter() - start

    processor.mm_item_inputs = timed
    return total


# ---------------------------------------------------------------------------- --micro
_MICRO_PROCESSOR = None


def _micro_init(path: str) -> None:
    global _MICRO_PROCESSOR
    import torch
    import torch.multiprocessing as _shared_tensors  # noqa: F401 - as mmkit's workers

    torch.set_num_threads(1)
    from transformers import AutoProcessor

    _MICRO_PROCESSOR = AutoProcessor.from_pretrained(path, local_files_only=True)


def _micro_one(img):
    return _MICRO_PROCESSOR.image_processor(images=[img.convert("RGB")], return_tensors="pt")["pixel_values"]


def micro(path: Path, images: list, repeats: int) -> dict:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    import torch

    _micro_init(str(path))
    _micro_one(images[0])
    pools = {"threads_1": ThreadPoolExecutor(1), "threads_2": ThreadPoolExecutor(2),
             "processes_2": ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"),
                                                initializer=_micro_init, initargs=(str(path),))}
    for pool in pools.values():
        list(pool.map(_micro_one, images[:4]))
    times: dict[str, list[float]] = {"serial": [], **{name: [] for name in pools}}
    for _ in range(repeats):
        start = time.perf_counter()
        want = [_micro_one(img) for img in images]
        times["serial"].append(time.perf_counter() - start)
        for name, pool in pools.items():
            start = time.perf_counter()
            got = list(pool.map(_micro_one, images))
            times[name].append(time.perf_counter() - start)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    for pool in pools.values():
        pool.shutdown()
    ms = {name: statistics.median(v) / len(images) * 1e3 for name, v in times.items()}
    # The GIL: a pure-Python spinner's rate alone, then beside the processor on this thread.
    stop = threading.Event()
    count = [0]

    def spin():
        while not stop.is_set():
            count[0] += 1

    rates = []
    for work in (lambda: stop.wait(1.0), lambda: [_micro_one(img) for img in images[:8]]):
        stop.clear()
        count[0] = 0
        spinner = threading.Thread(target=spin)
        start = time.perf_counter()
        spinner.start()
        work()
        stop.set()
        spinner.join()
        rates.append(count[0] / (time.perf_counter() - start))
    return {"ms_per_image": ms, "seconds": times, "gil_share": 1 - rates[1] / rates[0],
            "pixel_values_mb": want[0].numel() * want[0].element_size() / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    p.add_argument("--workers", type=int, default=2, help="mm_processor_workers of the `processes` engine")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 1280,
                   help="the processor's max_pixels (default the real checkpoints': a 1024x768 photo keeps its "
                        "size, 3996 patches; 200704 = 448x448, a common serving cap: 1036 patches, a vision "
                        "tower ~14x cheaper, so the processor's share of each request grows)")
    p.add_argument("--micro", action="store_true", help="also time the processor alone (see the docstring)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common.set_threads(args.threads)
    from mmkit import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result: dict = {"args": vars(args), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "qwen2-vl", args.max_pixels)
        if args.micro:
            result["micro"] = micro(path, photos(args.num_requests, 10_000), args.repeats)
            m = result["micro"]
            print("processor alone, ms/image: " + ", ".join(f"{k} {v:.1f}" for k, v in m["ms_per_image"].items())
                  + f"; GIL held {m['gil_share']:.0%} of its time; pixel_values {m['pixel_values_mb']:.1f} MB",
                  flush=True)
        kwargs = dict(dtype=args.dtype, max_model_len=2048, max_num_seqs=256)
        llms = {"serial": LLM(str(path), async_preprocess=False, **kwargs),
                "threads": LLM(str(path), **kwargs),
                "processes": LLM(str(path), mm_processor_workers=args.workers, **kwargs)}
        processor_seconds = _time_processor(llms["serial"])
        warm = photos(4, 20_000)
        for llm in llms.values():
            run_once(llm, warm, params)
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        processor_share: list[float] = []  # of the serial call, the processor's (where the time goes)
        for rep in range(args.repeats):
            images = photos(args.num_requests, 1 + rep * args.num_requests)
            order = MODES[rep % 3:] + MODES[:rep % 3]
            reference = None
            for mode in order:
                processor_seconds[0] = 0.0
                took, ids = run_once(llms[mode], images, params)
                reference = reference or ids
                if ids != reference:
                    raise SystemExit(f"repeat {rep}: greedy ids of {mode} differ from {order[0]}'s")
                seconds[mode].append(took)
                if mode == "serial":
                    processor_share.append(processor_seconds[0] / took)
                print(f"[{rep}] {mode:9s}: {took:6.2f} s, {args.num_requests / took:6.2f} req/s", flush=True)
        prefetch = {m: {"prefetched": llms[m].llm_engine.prefetcher.num_prefetched,
                        "inline": llms[m].llm_engine.prefetcher.num_inline} for m in ("threads", "processes")}
    med = {m: statistics.median(v) for m, v in seconds.items()}
    speedup = {m: [s / t for s, t in zip(seconds["serial"], seconds[m])] for m in MODES}
    result.update(seconds=seconds, median_seconds=med,
                  median_req_per_s={m: args.num_requests / v for m, v in med.items()},
                  speedup_over_serial_per_repeat=speedup,
                  median_speedup_over_serial={m: statistics.median(v) for m, v in speedup.items()},
                  identical_greedy_ids=True, prefetch=prefetch, serial_processor_share=processor_share)
    print(f"\n{args.num_requests} requests, 1024x768 photos, {args.max_tokens} tokens, {args.dtype}, "
          f"{args.threads} engine threads, {result['cpu']}; median of {args.repeats}")
    print(f"serial: the processor's item work is {statistics.median(processor_share):.0%} of the call")
    for m in MODES:
        print(f"{m:9s}: {med[m]:6.2f} s  {args.num_requests / med[m]:6.2f} req/s  "
              f"x{result['median_speedup_over_serial'][m]:.2f} vs serial (per repeat: "
              f"{', '.join(f'{r:.2f}' for r in speedup[m])})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
