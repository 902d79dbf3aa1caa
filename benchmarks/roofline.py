"""Decode throughput of a LLaVA-1.5-7B-shaped decoder as a fraction of the HBM roofline.

    python benchmarks/roofline.py [--bandwidth 4.8e12] [--batch-sizes 1,2,4,8,16,32,64,128] \
        [--context-len 640] [--steps 20] [--json out.json]
    python benchmarks/roofline.py --device cpu --tiny      # dry run of the same code, tiny shape

Builds mmkit's own paged Llama decoder (32 layers, hidden 4096, 32 heads, intermediate 11008,
vocab 32064, bfloat16) with random weights directly in device memory (nothing is written to
disk; the vision tower is irrelevant to decode), fills each sequence's KV cache to
`--context-len` tokens, and times decode steps (decoder forward, LM head, greedy argmax on the
device) at each batch size. One decode step must read every weight once and every live K/V
entry once, so

    roofline step time = (weight bytes + batch * context * KV bytes per token) / bandwidth

and the table reports achieved / roofline. Exits with a message when CUDA is not available
(unless `--device cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {
    "llava-1.5-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32064),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def build_decoder(shape: dict, max_positions: int, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig

    from mmkit.models.llama import Linear, LlamaModel, pack_linears

    config = LlamaConfig(**shape, max_position_embeddings=max_positions, rms_norm_eps=1e-5)
    with torch.device(device):
        decoder = LlamaModel(config, max_positions)
        lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
    decoder.fuse_weights()
    decoder = decoder.to(dtype).eval()
    lm_head = lm_head.to(dtype).eval()
    decoder.rotary.float()
    with torch.no_grad():  # small random weights keep activations finite
        for p in list(decoder.parameters()) + list(lm_head.parameters()):
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    pack_linears(decoder)
    pack_linears(lm_head)
    return config, decoder, lm_head


def weight_bytes(decoder, lm_head) -> int:
    # Every decoder matmul weight and norm is read once per step; of the embedding only the
    # batch's rows (negligible) are read, so it is left out.
    skip = {id(decoder.embed_tokens.weight)}
    params = [p for p in decoder.parameters() if id(p) not in skip] + list(lm_head.parameters())
    return sum(p.numel() * p.element_size() for p in params)


@torch.inference_mode()
def measure(config, decoder, lm_head, batch: int, context_len: int, steps: int, block_size: int,
            dtype: torch.dtype, device: torch.device) -> dict:
    from mmkit.layers.attention import AttentionMetadata, build_decode_metadata, kv_cache_shape

    head_dim = config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads
    max_len = context_len + steps + 4
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    kv_caches = [(torch.randn(shape, dtype=dtype, device=device) * 0.1,
                  torch.randn(shape, dtype=dtype, device=device) * 0.1)
                 for _ in range(config.num_hidden_layers)]
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    token_ids = torch.randint(0, config.vocab_size, (batch,), device=device)

    def step(pos: int) -> torch.Tensor:
        # Batch preparation is part of the step, as in the engine.
        meta = AttentionMetadata(slot_mapping=torch.tensor(
            [t[pos // block_size] * block_size + pos % block_size for t in tables], device=device))
        build_decode_metadata(meta, tables, [pos + 1] * batch, block_size, device)
        positions = torch.full((batch,), pos, dtype=torch.long, device=device)
        hidden = decoder(decoder.embed_tokens(token_ids), positions, kv_caches, meta)
        return lm_head(hidden).argmax(dim=-1)

    for w in range(3):
        step(context_len + w)
    _sync(device)
    start = time.perf_counter()
    for s in range(steps):
        step(context_len + s)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    del kv_caches
    kv_bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return {"batch": batch, "step_ms": 1e3 * seconds, "tokens_per_s": batch / seconds,
            "kv_bytes": batch * (context_len + steps // 2) * kv_bytes_per_token}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny decoder (dry run of the code path)")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth, bytes/s (H200: 4.8e12)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128")
    p.add_argument("--context-len", type=int, default=640, help="tokens already in each sequence's cache")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("roofline: no CUDA GPU available; nothing measured (use --device cpu --tiny for a dry run)")
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    shape = SHAPES["tiny" if args.tiny else "llava-1.5-7b"]
    max_positions = args.context_len + args.steps + 8
    config, decoder, lm_head = build_decoder(shape, max_positions, dtype, device)
    w_bytes = weight_bytes(decoder, lm_head)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{'tiny' if args.tiny else 'LLaVA-1.5-7B'}-shaped decoder, bf16, {w_bytes / 1e9:.2f} GB of weights, "
          f"context {args.context_len}, {name}, bandwidth {args.bandwidth:.3g} B/s")
    print(f"{'batch':>5s} {'step ms':>9s} {'tok/s':>10s} {'roofline ms':>12s} {'of roofline':>12s}")
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",") if x]:
        r = measure(config, decoder, lm_head, b, args.context_len, args.steps, args.block_size, dtype, device)
        roof_s = (w_bytes + r["kv_bytes"]) / args.bandwidth
        r["roofline_ms"] = 1e3 * roof_s
        r["fraction_of_roofline"] = roof_s / (r["step_ms"] / 1e3)
        rows.append(r)
        print(f"{b:5d} {r['step_ms']:9.2f} {r['tokens_per_s']:10.1f} {r['roofline_ms']:12.3f} "
              f"{r['fraction_of_roofline']:12.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": name, "weight_bytes": w_bytes,
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
