"""Overlapped preprocessing on the main job: caption many large photos with the embedded model.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/caption_photos.py --num-images 64 --repeats 3

A notebook user's captioning loop: N distinct 1024x768 JPEG photos on disk (crops of the
upscaled `assets/photos`, written once before any timing), each opened with `Image.open`
(lazy: the file is decoded on first access, as PIL does), one chat prompt per photo
("Describe the image.") through `LLM.generate`, greedy, `--max-tokens` tokens. The same
engine settings twice in one process, `async_preprocess` on and off (order alternating per
repeat; each repeat its own photos, so no engine ever sees an image twice): the file decode, content hash and HF image processing run on the prefetch
workers or on the engine thread. Reports images/s, TTFT p50 (from the call; `RequestOutput`
metrics) and the paired on/off ratios (median of `--repeats`); the captions must be identical.

With the embedded 4.4M-parameter model the per-image preprocessing (decode a 1024x768 JPEG,
hash 2.4 MB of pixels, resize + normalise) costs about as much as the model's work per image,
which is the case overlapped preprocessing is for; `throughput.py --ab-async` measures the
same switch on the 30-layer benchmark LLaVA, where the model dominates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def write_photos(folder: Path, n: int, first_seed: int) -> list[Path]:
    """n distinct 1024x768 JPEG crops (seed -> photo and crop offset)."""
    common.LARGE_IMAGES = True
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(first_seed, first_seed + n):
        paths.append(folder / f"photo_{seed:05d}.jpg")
        common.make_image(seed, 0).save(paths[-1], quality=90)
    return paths


def run_once(llm, paths: list[Path], params) -> tuple[float, float, list]:
    from PIL import Image

    from mmkit.entrypoints.cli.main import CAPTION_QUESTION, question_inputs

    images = [Image.open(p) for p in paths]  # lazy: decoded inside the timed call, by whoever needs it
    inputs = [question_inputs(llm, img, CAPTION_QUESTION) for img in images]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = statistics.median(o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs)
    return seconds, ttft, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common.set_threads(args.threads)
    from mmkit import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    runs: dict[str, list] = {"on": [], "off": [], "ttft_on": [], "ttft_off": []}
    with tempfile.TemporaryDirectory() as tmp:
        # Each repeat its own photos (both modes the same ones): the engines' prefix and
        # encoder caches never see an image twice.
        photos = [write_photos(Path(tmp) / str(rep), args.num_images, 1 + rep * args.num_images)
                  for rep in range(args.repeats)]
        warm = write_photos(Path(tmp) / "warm", 4, 1 + args.repeats * args.num_images)
        llms = {"on": LLM(None, seed=0), "off": LLM(None, seed=0, async_preprocess=False)}
        for llm in llms.values():
            run_once(llm, warm, params)
        for rep in range(args.repeats):
            order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
            reference = None
            for name in order:
                seconds, ttft, ids = run_once(llms[name], photos[rep], params)
                reference = reference or ids
                if ids != reference:
                    raise SystemExit(f"repeat {rep}: captions with async_preprocess {name} differ from the other mode's")
                runs[name].append(args.num_images / seconds)
                runs["ttft_" + name].append(ttft)
                print(f"[{rep}] async_preprocess {name:3s}: {args.num_images / seconds:6.2f} images/s "
                      f"({seconds:.2f} s), TTFT p50 {ttft:.2f} s", flush=True)
        prefetcher = llms["on"].llm_engine.prefetcher
        counts = {"prefetched": prefetcher.num_prefetched, "inline": prefetcher.num_inline}
    ratios = [a / b for a, b in zip(runs["on"], runs["off"])]
    ttft_ratios = [a / b for a, b in zip(runs["ttft_on"], runs["ttft_off"])]
    result = {"args": vars(args), "runs": runs, "throughput_ratio_per_repeat": ratios,
              "median_throughput_ratio": statistics.median(ratios), "ttft_ratio_per_repeat": ttft_ratios,
              "median_ttft_ratio": statistics.median(ttft_ratios), **counts}
    print(f"\n{args.num_images} photos 1024x768, embedded model, {args.max_tokens} tokens, median of {args.repeats}")
    print(f"async on  : {statistics.median(runs['on']):6.2f} images/s, TTFT p50 {statistics.median(runs['ttft_on']):.2f} s")
    print(f"async off : {statistics.median(runs['off']):6.2f} images/s, TTFT p50 {statistics.median(runs['ttft_off']):.2f} s")
    print(f"throughput on/off per repeat: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {result['median_throughput_ratio']:.2f}x)")
    print(f"TTFT p50 on/off per repeat  : {', '.join(f'{r:.2f}' for r in ttft_ratios)} "
          f"(median {result['median_ttft_ratio']:.2f}x)")
    print(f"images from the workers: {counts['prefetched']}, computed inline: {counts['inline']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
