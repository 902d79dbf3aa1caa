"""End to end on a GPU: a 7B-shaped random VLM through mmkit and through transformers.

    python benchmarks/gpu/e2e.py --shape llava-7b --out DIR          # on a CUDA machine
    python benchmarks/gpu/e2e.py --shape tiny-llava --device cpu --out DIR   # the dry run
    python benchmarks/gpu/e2e.py --summarize DIR                     # DIR/summary.json + goals

The checkpoint is built offline: the family's tiny builder writes the tokenizer and processor
(`mmkit.testing`), the config is scaled to the named shape (LLaVA-1.5-7B: Llama-7B decoder,
CLIP-L/336 tower; Qwen2-VL-7B: 28 layers x 3584, 4 KV heads, its 32-block vision tower), and
the model is initialised on the device with random N(0, 0.02) weights and saved. Then:

1. transformers' best static batch: `generate` (greedy, exactly --max-tokens new tokens) on
   one batch of each size in --hf-batch-sizes; tokens/s = batch * max_tokens / seconds.
2. mmkit, decode-heavy: --num-requests image prompts with --max-tokens each, one `generate`;
   and batch 1 (one request alone). Tokens/s of output.
3. The decode-step bandwidth: every decode-only engine step is timed; its bytes are the
   decoder and LM-head weights plus the K/V of every live token, against --hbm-bandwidth
   (the device's HBM peak from a table, or given).
4. A kernel profile (torch.profiler) of a few decode steps: the top kernels by device time.

Results: DIR/e2e_<shape>.json and DIR/kernels_<shape>.txt; logs on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# Per shape: the architecture, the tiny builder's arguments (tokenizer/processor geometry), and
# the text / vision config fields scaled to the real model's shape.
SHAPES = {
    "llava-7b": dict(
        arch="LlavaForConditionalGeneration", builder=dict(image_size=336, patch_size=14),
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, head_dim=128, vocab_size=32064, max_position_embeddings=4096),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        image=336, prompt="USER: <image>\n{} ASSISTANT:"),
    "qwen2-vl-7b": dict(
        arch="Qwen2VLForConditionalGeneration",
        builder=dict(patch_size=14, min_pixels=56 * 56, max_pixels=448 * 448),
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
        vision=dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=3584, mlp_ratio=4),
        image=448, prompt="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
                          "<|im_start|>assistant\n"),
    # The dry run's shapes: the same code paths, a vocabulary larger than the tokenizer's as above.
    "tiny-llava": dict(
        arch="LlavaForConditionalGeneration", builder=dict(image_size=32, patch_size=8),
        text=dict(vocab_size=1024), vision={}, image=32, prompt="USER: <image>\n{} ASSISTANT:"),
    "tiny-qwen2-vl": dict(
        arch="Qwen2VLForConditionalGeneration", builder=dict(),
        text=dict(vocab_size=1024), vision={}, image=32,
        prompt="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"),
}

# HBM peak bandwidth (bytes/s) by device name; --hbm-bandwidth overrides.
HBM = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
       "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12}
WORDS = "describe the picture in great detail please and name every object you can see".split()


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hbm_bandwidth(device: torch.device, given: float | None) -> float:
    if given:
        return given
    if device.type != "cuda":
        return 50e9  # nominal, for the dry run's arithmetic only
    name = torch.cuda.get_device_name(device)
    for key, value in HBM.items():
        if key in name:
            return value
    raise SystemExit(f"e2e: no HBM bandwidth known for {name!r}; pass --hbm-bandwidth")


def build_checkpoint(shape: str, out: Path, device: torch.device, dtype: torch.dtype):
    """The shape's random checkpoint in `out`; returns the HF model (on the device, eval)."""
    import transformers

    from mmkit.testing import build_tiny_checkpoint

    spec = SHAPES[shape]
    build_tiny_checkpoint(spec["arch"], out, **spec["builder"])
    config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
    for key, value in spec["text"].items():
        setattr(config.text_config, key, value)
    for key, value in spec["vision"].items():
        setattr(config.vision_config, key, value)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, spec["arch"])(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model = model.to(dtype).eval()
    model.save_pretrained(out)
    return model


def make_inputs(shape: str, num: int, prompt_words: int):
    from PIL import Image

    spec = SHAPES[shape]
    inputs = []
    for i in range(num):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(prompt_words))
        color = (37 * i % 256, 91 * i % 256, 53 * i % 256)
        image = Image.new("RGB", (spec["image"], spec["image"]), color)
        inputs.append({"prompt": spec["prompt"].format(text), "multi_modal_data": {"image": image}})
    return inputs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_best_static_batch(model, path: Path, inputs: list, batch_sizes: list[int], max_tokens: int,
                         device: torch.device) -> dict:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    processor.tokenizer.padding_side = "left"
    pad = processor.tokenizer.pad_token_id
    results = {}
    for i, batch in enumerate([b for b in batch_sizes if b <= len(inputs)]):
        chunk = inputs[:batch]
        enc = processor(text=[x["prompt"] for x in chunk], images=[x["multi_modal_data"]["image"] for x in chunk],
                        padding=True, return_tensors="pt").to(device)
        if "pixel_values" in enc:
            enc["pixel_values"] = enc["pixel_values"].to(model.dtype)
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        if i == 0:
            model.generate(**enc, **dict(kwargs, max_new_tokens=2, min_new_tokens=2))  # warm-up
        sync(device)
        start = time.perf_counter()
        model.generate(**enc, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
        results[batch] = batch * max_tokens / seconds
        log(f"transformers static batch {batch}: {results[batch]:.1f} tok/s ({seconds:.2f} s)")
    best = max(results, key=results.get)
    return {"tok_s_by_batch": results, "best_batch": best, "best_tok_s": results[best],
            "batch1_tok_s": results.get(1)}


class StepTimer:
    """Times the runner's `execute_model` calls; keeps the decode-only ones with their context."""

    def __init__(self, runner, device: torch.device) -> None:
        self.runner, self.device, self.steps = runner, device, []
        self._inner = runner.execute_model
        runner.execute_model = self._timed

    def _timed(self, sched):
        is_decode = bool(sched.num_scheduled_tokens) and all(n == 1 for n in sched.num_scheduled_tokens.values())
        ids = list(sched.num_scheduled_tokens)
        sync(self.device)
        start = time.perf_counter()
        out = self._inner(sched)
        sync(self.device)
        if is_decode:
            context = sum(self.runner.states[s].num_computed_tokens for s in ids if s in self.runner.states)
            self.steps.append((len(ids), context, time.perf_counter() - start))
        return out

    def close(self) -> None:
        self.runner.execute_model = self._inner


def decoder_weight_bytes(runner) -> int:
    """Bytes a decode step reads once: the decoder's and LM head's weights (not the vision tower,
    the projector, nor the embedding table, of which a step reads a few rows)."""
    skip = ("vision", "visual", "projector", "merger", "embed_tokens")
    total = 0
    for name, p in runner.model.named_parameters():
        if not any(s in name for s in skip):
            total += p.numel() * p.element_size()
    head = getattr(runner.model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is not None and weight.data_ptr() == getattr(getattr(runner.model, "embed_tokens", None), "weight",
                                                             weight).data_ptr():
        total += weight.numel() * weight.element_size()  # tied: the head reads the whole table
    return total


def run_mmkit(path: Path, inputs: list, max_tokens: int, args, device: torch.device) -> dict:
    from mmkit import LLM, SamplingParams
    from mmkit.worker.kv_cache import bytes_per_block

    kwargs = dict(dtype=args.dtype, device=device.type, max_num_seqs=len(inputs), seed=0,
                  enforce_eager=args.enforce_eager, attention_backend=args.attention_backend)
    if device.type == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.num_kv_blocks:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    start = time.perf_counter()
    llm = LLM(str(path), **kwargs)
    runner = llm.llm_engine.model_runner
    if args.stand_in_graphs and device.type == "cpu":  # the dry run: decode steps through the graph buffers
        from mmkit.worker.cuda_graphs import DecodeGraphs

        DecodeGraphs.enable(runner)
    result = {"load_s": time.perf_counter() - start, "attention_backend": runner.attention_backend,
              "cuda_graphs": runner.decode_graphs is not None, "num_kv_blocks": runner.num_blocks}
    if runner.memory_profile is not None:
        result["memory_profile"] = runner.memory_profile.describe()
    log(f"mmkit loaded in {result['load_s']:.1f} s: backend {runner.attention_backend}, "
        f"graphs {result['cuda_graphs']}, {runner.num_blocks} KV blocks")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(inputs[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    timer = StepTimer(runner, device)
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    timer.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["decode_heavy"] = {"requests": len(inputs), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
    log(f"mmkit decode-heavy: {tokens / seconds:.1f} tok/s ({len(inputs)} requests, {seconds:.2f} s)")
    start = time.perf_counter()
    one = llm.generate(inputs[:1], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result["batch1"] = {"tokens": len(one[0].outputs[0].token_ids), "seconds": seconds,
                        "tok_s": len(one[0].outputs[0].token_ids) / seconds}
    log(f"mmkit batch 1: {result['batch1']['tok_s']:.1f} tok/s")
    result["decode_step"] = decode_bandwidth(timer.steps, runner, args, device)
    result["kernel_profile"] = kernel_profile(llm, inputs, args, device)
    per_token = bytes_per_block(runner.config.model, runner.block_size) // runner.block_size
    result["kv_bytes_per_token"] = per_token
    del llm, runner, timer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def decode_bandwidth(steps: list, runner, args, device: torch.device) -> dict:
    """Bandwidth of the decode-only steps at the step's largest batch, against the HBM peak."""
    from mmkit.worker.kv_cache import bytes_per_block

    if not steps:
        return {}
    weights = decoder_weight_bytes(runner)
    per_token = bytes_per_block(runner.config.model, runner.block_size) // runner.block_size
    top = max(n for n, _, _ in steps)
    at_top = [(ctx, sec) for n, ctx, sec in steps if n == top]
    fractions, rates = [], []
    peak = hbm_bandwidth(device, args.hbm_bandwidth)
    for ctx, sec in at_top:
        rate = (weights + ctx * per_token) / sec
        rates.append(rate)
        fractions.append(rate / peak)
    out = {"batch": top, "steps": len(at_top), "weight_bytes": weights, "kv_bytes_per_token": per_token,
           "median_step_ms": 1e3 * statistics.median(s for _, s in at_top),
           "median_bytes_per_s": statistics.median(rates), "hbm_peak_bytes_per_s": peak,
           "fraction_of_roofline": statistics.median(fractions)}
    log(f"decode step at batch {top}: {out['median_step_ms']:.2f} ms, "
        f"{out['median_bytes_per_s'] / 1e9:.0f} GB/s = {100 * out['fraction_of_roofline']:.1f}% of {peak / 1e9:.0f} GB/s")
    return out


def kernel_profile(llm, inputs: list, args, device: torch.device) -> list:
    from torch.profiler import ProfilerActivity, profile

    from mmkit import SamplingParams

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    params = SamplingParams(temperature=0, max_tokens=args.profile_tokens, ignore_eos=True)
    with profile(activities=activities) as prof:
        llm.generate(inputs, params, use_tqdm=False)
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    Path(args.out, f"kernels_{args.shape}.txt").write_text(table)
    rows = []
    for evt in sorted(prof.key_averages(), key=lambda e: getattr(e, "device_time_total", 0) or e.cpu_time_total,
                      reverse=True)[:15]:
        rows.append({"name": evt.key, "calls": evt.count, "device_us": getattr(evt, "device_time_total", 0),
                     "cpu_us": evt.cpu_time_total})
    log(f"kernel profile: {len(rows)} top entries -> kernels_{args.shape}.txt")
    return rows


def summarize(out: Path) -> dict:
    """DIR/summary.json from every e2e_*.json there, with the issue's goals checked."""
    summary = {"runs": {}, "goals": {}}
    for f in sorted(out.glob("e2e_*.json")):
        data = json.loads(f.read_text())
        shape = data["shape"]
        hf, mm = data.get("transformers", {}), data.get("mmkit", {})
        ratio = mm["decode_heavy"]["tok_s"] / hf["best_tok_s"] if hf.get("best_tok_s") else None
        run = {"device": data["device"], "decode_heavy_tok_s": mm["decode_heavy"]["tok_s"],
               "hf_best_tok_s": hf.get("best_tok_s"), "hf_best_batch": hf.get("best_batch"),
               "decode_heavy_vs_hf_best": ratio, "batch1_tok_s": mm["batch1"]["tok_s"],
               "hf_batch1_tok_s": hf.get("batch1_tok_s"),
               "decode_step_fraction_of_roofline": mm.get("decode_step", {}).get("fraction_of_roofline")}
        summary["runs"][shape] = run
        if shape.endswith("7b"):
            summary["goals"][f"{shape}: decode-heavy >= 4x transformers' best batch"] = bool(ratio and ratio >= 4)
            frac = run["decode_step_fraction_of_roofline"]
            summary["goals"][f"{shape}: decode step >= 60% of the HBM roofline"] = bool(frac and frac >= 0.6)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llava-7b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", default="benchmarks/results/gpu/latest")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--hf-batch-sizes", default="1,8,32,64")
    p.add_argument("--hbm-bandwidth", type=float, default=None, help="bytes/s (default: by device name)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--profile-tokens", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized by the memory profile")
    p.add_argument("--attention-backend", default="auto", help="auto: flex on CUDA, torch on CPU")
    p.add_argument("--stand-in-graphs", action="store_true",
                   help="CPU: run decode steps through the CUDA-graph buffers (the stand-in, no capture)")
    p.add_argument("--summarize", metavar="DIR", default=None)
    args = p.parse_args()
    if args.summarize:
        summarize(Path(args.summarize))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("e2e: no CUDA GPU here (use --device cpu for the dry run)")
        return 2
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ckpt_{args.shape}"
    log(f"building {args.shape} ({args.dtype}) on {device} into {path}")
    start = time.perf_counter()
    model = build_checkpoint(args.shape, path, device, dtype)
    log(f"built and saved in {time.perf_counter() - start:.1f} s")
    inputs = make_inputs(args.shape, args.num_requests, args.prompt_words)
    batches = [int(b) for b in args.hf_batch_sizes.split(",")]
    hf = hf_best_static_batch(model, path, inputs, batches, args.max_tokens, device)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    mm = run_mmkit(path, inputs, args.max_tokens, args, device)
    env = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu"}
    import transformers

    env["transformers"] = transformers.__version__
    result = {"shape": args.shape, "device": env["device_name"], "env": env, "dtype": args.dtype,
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "transformers": hf, "mmkit": mm}
    if hf.get("best_tok_s"):
        result["decode_heavy_vs_hf_best"] = mm["decode_heavy"]["tok_s"] / hf["best_tok_s"]
        log(f"decode-heavy: {result['decode_heavy_vs_hf_best']:.2f}x transformers' best static batch "
            f"({hf['best_batch']})")
    (out / f"e2e_{args.shape}.json").write_text(json.dumps(result, indent=2, default=str))
    import shutil

    shutil.rmtree(path, ignore_errors=True)  # the checkpoint: gigabytes, rebuilt in seconds
    return 0


if __name__ == "__main__":
    sys.exit(main())
