"""The GEMM floor of a `peers.py` workload: the decoder's projections and the LM head that any
engine must run for it, and nothing else, timed on this machine.

    OMP_WAIT_POLICY=PASSIVE nice python benchmarks/gemm_floor.py --workload decode-heavy \
        [--dtype float32] [--threads 2] [--num-layers 30] [--kernels panels F.linear]
    /path/to/vllm-venv/bin/python benchmarks/gemm_floor.py --workload decode-heavy --kernels vllm-onednn

Why: when a run is nearly all GEMM (float32 on a CPU without a faster float32 unit), a ratio of
two engines' tok/s is bounded by how much faster one GEMM is than the other. This replays the
workload's projection GEMMs alone with mmkit's panels, torch's `F.linear` (MKL in float32, oneDNN
in bf16) or vLLM-CPU's own prepacked oneDNN matmul (run by vLLM's python), so `peers.py --floor` can put, beside each pair's vLLM run, the tok/s an engine
with zero cost outside these GEMMs would reach: the largest mmkit / vLLM ratio those GEMMs allow
at that moment of the host.

What is counted, per token through the decoder: the fused qkv, o, fused gate/up and down
projections of every layer (from the checkpoint's config); per sampled token: the LM head (one
row per generated token; prefill computes logits for each prompt's last token only, as both
engines do). Not counted: attention, norms, the vision tower, sampling and the engine, so the
floor is a lower bound on any engine's time.

The schedule replayed: the prompts' tokens in chunks of `chunk` rows (all prefill first; each
chunk's LM-head rows are the prompts that end in it), then one decode step per output position
with every request still generating (the largest batch each step can have). A scheduler that
mixes prefill rows into late decode steps could make those GEMMs larger, so the script also
reports the absolute bound: all FLOPs at the best rate any replayed step reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

# mmkit's panels and torch's F.linear run in mmkit's environment; vLLM's prepacked oneDNN matmul
# (`create_onednn_mm` / `onednn_mm`, its CPU dispatch for unquantized linears) in vLLM's own venv.
KERNELS = ("panels", "F.linear", "vllm-onednn")


@dataclass(frozen=True)
class Shapes:
    """The GEMMs of one decoder layer as (out, in) pairs, the layer count and the LM head; and
    `kv_width`, the K and V elements one token leaves in one layer's cache."""
    layer: tuple[tuple[int, int], ...]
    num_layers: int
    lm_head: tuple[int, int]
    kv_width: int

    @classmethod
    def of_text_config(cls, text) -> Shapes:
        h, heads = text.hidden_size, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        inter = text.intermediate_size
        # fused qkv, o, fused gate/up, down: the fused forms both engines run
        layer = (((heads + 2 * kv) * head_dim, h), (h, heads * head_dim), (2 * inter, h), (h, inter))
        return cls(layer, text.num_hidden_layers, (text.vocab_size, h), 2 * kv * head_dim)

    def token_flops(self) -> int:
        return 2 * self.num_layers * sum(n * k for n, k in self.layer)

    def logit_flops(self) -> int:
        return 2 * self.lm_head[0] * self.lm_head[1]


def checkpoint_shapes(model: str) -> tuple[Shapes, int | None]:
    """(the decoder's Shapes, image tokens per image) of a checkpoint directory; the image
    tokens only where a fixed-size tower sets them (LLaVA), else None (Qwen2-VL: the spec's)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    vision = cfg.vision_config
    size = getattr(vision, "image_size", None)
    return Shapes.of_text_config(cfg.text_config), (size // vision.patch_size) ** 2 if size else None


def kv_read_bytes(prompt_lens: list[int], out_lens: list[int], shapes: Shapes, elem_bytes: int) -> int:
    """Cache bytes any engine reads for these requests: each decode step j (1 .. n-1: the first
    output token comes from the prefill) attends its prompt plus j rows of K and V in every
    layer, and each prompt's own rows are read once while it is prefilled."""
    rows = sum((n - 1) * p + n * (n - 1) // 2 + p for p, n in zip(prompt_lens, out_lens))
    return rows * shapes.num_layers * shapes.kv_width * elem_bytes


class Step(NamedTuple):
    rows: int  # tokens through the decoder's projections
    logit_rows: int  # rows through the LM head
    prefill: bool


def schedule(prompt_lens: list[int], out_lens: list[int], chunk: int) -> list[Step]:
    """The replayed steps: the prompts back to back in chunks of
    `chunk` tokens, then a decode step per output position for every request still generating."""
    if chunk < 1 or any(n < 1 for n in prompt_lens) or any(n < 1 for n in out_lens):
        raise ValueError("chunk, prompt and output lengths must be positive")
    steps, ends, total = [], [], 0
    for n in prompt_lens:
        total += n
        ends.append(total)
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        steps.append(Step(stop - start, sum(start < e <= stop for e in ends), True))
    for pos in range(1, max(out_lens)):
        live = sum(n > pos for n in out_lens)
        steps.append(Step(live, live, False))
    return steps


def workload_lengths(spec: dict, image_tokens: int) -> tuple[list[int], list[int]]:
    """Prompt lengths as the decoder sees them (the prompt's other special tokens: <s> for
    LLaVA, vision start and end for Qwen; the image's tokens; the text) and output lengths of
    the timed requests `peer_worker.py` builds for `spec` (its first repeat)."""
    from peer_worker import workload

    extra = len(spec.get("prompt_prefix", [0, 0])) - 1  # the image token itself is the image's tokens
    reqs = workload(spec, seed=spec["seed"])
    return [extra + image_tokens + len(r.text_ids) for r in reqs], [r.max_tokens for r in reqs]


class Kernel:
    """One GEMM implementation bound to random weights of the model's shapes: a distinct copy
    per layer, so that they come from memory as in a run."""

    def __init__(self, name: str, shapes: Shapes, dtype) -> None:
        import torch
        import torch.nn.functional as F

        gen = torch.Generator().manual_seed(0)

        def weight(n, k):
            return (0.02 * torch.randn(n, k, generator=gen)).to(dtype)
        self._keep = []  # packed panels must stay alive while their runners are used
        if name == "F.linear":
            def bound(w):
                self._keep.append(w)
                return lambda x: F.linear(x, w)
        elif name == "panels":
            from mmkit.layers import linear_panels

            if not linear_panels.available():
                raise SystemExit("mmkit's panel kernels are not available on this CPU/build")

            def bound(w):
                self._keep.append(linear_panels.pack(w))
                return linear_panels.bind(self._keep[-1], w.shape[0], None)
        elif name == "vllm-onednn":
            # vLLM-CPU 0.32's `dispatch_cpu_unquantized_gemm` on x86 without AMX or zentorch: its
            # prepacked oneDNN matmul, for float32 and bf16 alike (AMX hosts take SGL kernels for bf16)
            from vllm import _custom_ops as ops

            def bound(w):
                handler = ops.create_onednn_mm(w.t(), 32)
                self._keep.append((w, handler))
                return lambda x: ops.onednn_mm(handler, x, None)
        else:
            raise ValueError(f"kernel: got {name!r}; expected one of {KERNELS}")
        self.name, self.shapes, self.dtype = name, shapes, dtype
        self.layers = [[(bound(weight(n, k)), k) for n, k in shapes.layer] for _ in range(shapes.num_layers)]
        self.head = bound(weight(*shapes.lm_head))

    def replay(self, steps: list[Step]) -> list[float]:
        """Seconds of each step's GEMMs: every layer's projections on the step's rows, then the LM
        head on its logit rows. Inputs are made before each step's timer."""
        import torch

        widths = {k for _, k in self.layers[0]}
        times = []
        for rows, logit_rows, _ in steps:
            xs = {k: torch.randn(rows, k).to(self.dtype) for k in widths}
            h = torch.randn(logit_rows, self.shapes.lm_head[1]).to(self.dtype)
            t0 = time.perf_counter()
            for layer in self.layers:
                for run, k in layer:
                    run(xs[k])
            if logit_rows:
                self.head(h)
            times.append(time.perf_counter() - t0)
        return times


def measure(spec: dict, kernels: list[str], chunk: int = 2048) -> dict:
    """The floor of `spec`'s workload (peers.workload_spec) for each kernel in `kernels`."""
    import torch

    common.set_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    shapes, image_tokens = checkpoint_shapes(spec["model"])
    image_tokens = spec.get("image_tokens", image_tokens)
    prompt_lens, out_lens = workload_lengths(spec, image_tokens)
    steps = schedule(prompt_lens, out_lens, chunk)
    flops = [s.rows * shapes.token_flops() + s.logit_rows * shapes.logit_flops() for s in steps]
    result = {"output_tokens": sum(out_lens), "prompt_tokens": sum(prompt_lens), "steps": len(steps),
              "tflop": sum(flops) / 1e12, "kernels": {}}
    for name in kernels:
        kernel = Kernel(name, shapes, dtype)
        kernel.replay(steps[:1] + steps[-1:])  # warm-up: first touch of weights and buffers
        times = kernel.replay(steps)
        best = max(f / t for f, t in zip(flops, times))
        result["kernels"][name] = {
            "seconds": sum(times), "tok_s": sum(out_lens) / sum(times),
            "gflops": sum(flops) / sum(times) / 1e9, "best_step_gflops": best / 1e9,
            # every FLOP at the best rate any step reached: no schedule does better with this GEMM
            "bound_tok_s": sum(out_lens) / (sum(flops) / best),
            "prefill_gflops": _rate(flops, times, steps, prefill=True),
            "decode_gflops": _rate(flops, times, steps, prefill=False)}
        del kernel
    return result


def _rate(flops, times, steps, prefill: bool) -> float:
    picked = [(f, t) for f, t, s in zip(flops, times, steps) if s.prefill == prefill]
    return sum(f for f, _ in picked) / max(sum(t for _, t in picked), 1e-12) / 1e9


def main() -> None:
    from peers import WORKLOADS, workload_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--workload", default="decode-heavy", choices=[w for w in WORKLOADS if w != "batch1"])
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--kernels", nargs="+", default=["panels", "F.linear"], choices=KERNELS,
                   help="vllm-onednn needs this script run by vLLM-CPU's python")
    p.add_argument("--chunk", type=int, default=2048, help="prefill rows per step in the replayed schedule")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    spec = workload_spec(args.workload, args.dtype, threads=args.threads, num_layers=args.num_layers)
    res = measure(spec, args.kernels, args.chunk)
    print(f"{args.workload} {args.dtype}: {res['prompt_tokens']} prompt + {res['output_tokens']} output tokens, "
          f"{res['steps']} steps, {res['tflop']:.2f} TFLOP of projections and LM head")
    for name, k in res["kernels"].items():
        print(f"  {name:8s}: {k['seconds']:.1f} s = {k['tok_s']:.1f} tok/s ({k['gflops']:.1f} GFLOPS; prefill "
              f"{k['prefill_gflops']:.1f}, decode {k['decode_gflops']:.1f}); best step {k['best_step_gflops']:.1f} "
              f"GFLOPS -> bound {k['bound_tok_s']:.1f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
