"""One engine, one workload, in its own process: the child `benchmarks/peers.py` starts.

    python peer_worker.py SPEC.json OUT.json

SPEC names the system ("mmkit", "vllm", or "floor": the workload's projection GEMMs alone, see
`gemm_floor.py`), the checkpoint, dtype, threads, the workload and
what to measure. It runs under mmkit's interpreter or vLLM's own virtual environment, so it
imports neither engine at module level and shares only `common.make_workload` / `make_image`
(seeded prompts and images) with the other side: both systems get the same token ids and the
same PIL images, built before the timer starts.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (OpenMP environment before torch, as for every benchmark)


def build_engine(spec: dict):
    """(generate(inputs, max_tokens_list) -> list of token-id lists) for the chosen system,
    configured as its documentation recommends for offline CPU inference."""
    common.set_threads(spec["threads"])
    if spec["system"] == "mmkit":
        from mmkit import LLM, SamplingParams

        # The KV cache as vLLM's: the same size (VLLM_CPU_KVCACHE_SPACE), committed at start-up.
        llm = LLM(spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=spec["max_num_seqs"],
                  max_model_len=spec["max_model_len"], kv_cache_memory=int(spec["kv_cache_gib"] * (1 << 30)),
                  kv_cache_preallocate=spec["kv_cache_preallocate"])

        def params(n: int):
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

        def run(inputs, lens):
            outs = llm.generate(inputs, [params(n) for n in lens], use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        return run
    from vllm import LLM, SamplingParams  # vLLM's own venv

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], limit_mm_per_prompt={"image": 1})

    def run(inputs, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return run


PHOTOS = Path(__file__).resolve().parent / ".cache" / "photos-1024x768"


def photo(seed: int):
    """The request's 1024x768 photo crop (common._large_photo) as a JPEG file, written once, and
    opened lazily: the engine that gets it decodes it inside its own call."""
    from PIL import Image

    path = PHOTOS / f"{seed}.jpg"
    if not path.exists():
        PHOTOS.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        common._large_photo(seed).save(tmp, format="JPEG", quality=90)
        tmp.rename(path)
    return Image.open(path)


def inputs_of(reqs, spec: dict) -> list[dict]:
    # The same prompt form for both engines: token ids holding the image token once (each
    # engine's processor expands it to the tower's count), text ids above the special tokens,
    # and the request's own PIL image.
    lowest = spec.get("first_text_id", common.NUM_SPECIAL_TOKENS)
    prefix = spec.get("prompt_prefix", [common.BOS_ID, common.IMAGE_ID])

    def image(seed):
        return photo(seed) if spec.get("photos") else common.make_image(seed, spec["image_size"])
    return [{"prompt_token_ids": prefix + [t if t >= lowest else t + lowest for t in r.text_ids],
             "multi_modal_data": {"image": image(r.image_seed)}} for r in reqs]


def workload(spec: dict, seed: int):
    """Seeded requests: prompts of min..max_prompt random text tokens after one image,
    output lengths uniform in min_out..max_out (8..128 unless the spec says; forced with
    ignore_eos on both sides)."""
    return common.make_workload("mixed", spec["num_requests"], seed=seed, min_prompt=spec["min_prompt"],
                                max_prompt=spec["max_prompt"], min_out=spec.get("min_out", 8),
                                max_out=spec.get("max_out", 128))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    if spec["system"] == "floor":  # the workload's GEMMs alone (gemm_floor.py), no engine
        import gemm_floor

        out_path.write_text(json.dumps({"system": "floor", **gemm_floor.measure(spec, spec["floor_kernels"])}))
        return
    t0 = time.perf_counter()
    run = build_engine(spec)
    result: dict = {"system": spec["system"], "load_s": time.perf_counter() - t0}
    # Parity gate requests (same for both systems): greedy ids, compared by the parent.
    gate = common.make_workload("uniform", spec["parity_requests"], seed=12345, uniform_len=spec["parity_tokens"])
    result["parity_ids"] = run(inputs_of(gate, spec), [r.max_tokens for r in gate])
    warm = common.make_workload("mixed", 8, seed=999, max_out=16)
    run(inputs_of(warm, spec), [r.max_tokens for r in warm])  # warm-up: compile, caches, pools
    if spec["workload"] == "batch1":
        ttft, tpot = [], []
        for rep in range(spec["repeats"]):
            req = common.make_workload("uniform", 1, seed=500 + rep, uniform_len=spec["batch1_tokens"])
            x = inputs_of(req, spec)
            # TTFT: a call generating one token; TPOT: the extra time of N tokens over one.
            start = time.perf_counter()
            run(x, [1])
            first = time.perf_counter() - start
            x = inputs_of(common.make_workload("uniform", 1, seed=700 + rep, uniform_len=spec["batch1_tokens"]), spec)
            start = time.perf_counter()
            run(x, [spec["batch1_tokens"]])
            full = time.perf_counter() - start
            ttft.append(first)
            tpot.append((full - first) / (spec["batch1_tokens"] - 1))
        result.update(ttft_s=statistics.median(ttft), tpot_s=statistics.median(tpot),
                      ttft_runs=ttft, tpot_runs=tpot)
    else:
        runs = []
        for rep in range(spec["repeats"]):
            # A fresh seed per repeat: no prefix/encoder cache hit across repeats.
            reqs = workload(spec, seed=spec["seed"] + rep)
            x = inputs_of(reqs, spec)
            start = time.perf_counter()
            ids = run(x, [r.max_tokens for r in reqs])
            elapsed = time.perf_counter() - start
            if [len(i) for i in ids] != [r.max_tokens for r in reqs]:
                raise SystemExit(f"{spec['system']}: a different number of tokens than requested")
            runs.append(sum(r.max_tokens for r in reqs) / elapsed)
        result.update(tok_s=statistics.median(runs), tok_s_runs=runs)
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
