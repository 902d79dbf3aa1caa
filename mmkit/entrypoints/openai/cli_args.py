"""The `mmkit serve` flags (vLLM's names). Plain argparse: importing this needs no fastapi."""

from __future__ import annotations

import argparse
import json

from mmkit import envs


def _limit_mm(value: str) -> dict[str, int]:
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"got {value!r}; expected JSON like '{{\"image\": 4}}'") from exc
    if not isinstance(limits, dict) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                           for v in limits.values()):
        raise argparse.ArgumentTypeError(f"got {value!r}; expected JSON like '{{\"image\": 4}}'")
    return limits


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="checkpoint folder or cached model id (default: the embedded model)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use as `model` (default: --model, or 'default-model')")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="online weight-only quantization of the decoder's linear layers (a compressed-tensors checkpoint is detected without it)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--model-impl", default="auto", choices=["auto", "mmkit", "transformers"],
                   help="which implementation runs the model: auto (native when mmkit has it, else the transformers backend), mmkit, or transformers (transformers' own modules on mmkit's engine)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together (default 256)")
    g.add_argument("--limit-mm-per-prompt", type=_limit_mm, default=None, metavar="JSON",
                   help='most items per prompt, e.g. \'{"image": 4}\' (default: the engine\'s, 8 images)')
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free GPU memory for the KV cache (CUDA; default 0.9)")
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES", help="KV cache size in bytes")
    g.add_argument("--kv-cache-preallocate", action="store_true",
                   help="CPU: commit the whole KV cache's memory at start-up, as vLLM's CPU backend does "
                        "(no page faults while serving; resident memory is the whole cache from the start)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs (no effect on CPU)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "flex", "flashinfer", "flash_attn"],
                   help="kernels that read the paged KV cache (default auto: flex on CUDA, torch on CPU)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="exact number of KV cache blocks (CPU or GPU)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one "
                                                         "(default: the checkpoint's)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves unset: 'auto' = the checkpoint's "
                        "generation_config.json, 'vllm' = none (temperature 1, ...), or a folder holding one")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) per request")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters served by name: `model: NAME` in a request selects one (needs --enable-lora)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters in one engine step (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default --max-loras)")
    g.add_argument("--enable-tower-connector-lora", action="store_true",
                   help="adapters may change the vision tower and projector too")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--mm-processor-workers", type=int, default=0, metavar="N",
                   help="worker processes for the image processor's per-item work (default 0: two "
                        "threads of the engine's process; see docs/engine_args.md for sizing)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=envs.MMKIT_API_KEY,
                   help="require 'Authorization: Bearer KEY' on every route but /health (env MMKIT_API_KEY)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url may name local files (paths or file://) under DIR only (default: none)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts http(s) image URLs may come from, comma- or space-separated (default: none)")
    g.add_argument("--image-fetch-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds a whole image download may take (default: env MMKIT_IMAGE_FETCH_TIMEOUT, else 10)")
    g.add_argument("--max-image-fetch-bytes", type=int, default=None, metavar="BYTES",
                   help="largest image download (default: env MMKIT_MAX_IMAGE_FETCH_BYTES, else 20 MiB)")
    g.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                   help="largest image, width x height, checked before decoding (default: env "
                        "MMKIT_MAX_IMAGE_PIXELS, else 89478485)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), comma- or space-separated, '*' for any "
                        "(default: none; vLLM allows any)")
    g.add_argument("--no-ui", dest="enable_ui", action="store_false", help="do not serve the playground at /")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    g = parser.add_argument_group("Ray Serve (from a clone: pip install -e '.[ray-serve]')",
                                  "Serve the same API from engine replicas on Ray Serve, behind one endpoint at "
                                  "--host/--port; requests about one image stay on one replica.")
    g.add_argument("--ray-serve", action="store_true", help="run on Ray Serve (a local Ray unless --ray-address)")
    g.add_argument("--num-replicas", type=int, default=1, metavar="N", help="engine replicas (default 1)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing cluster, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else start Ray here)")
    g.add_argument("--num-gpus-per-replica", type=float, default=0, metavar="G",
                   help="GPUs each replica reserves (1: one replica per GPU; default 0)")
    g.add_argument("--num-cpus-per-replica", type=float, default=None, metavar="C",
                   help="CPUs each replica reserves and its torch threads on CPU (default 1)")
