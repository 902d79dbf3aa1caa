"""Round 4p: the floor of a peers.py workload with its K/V reads added to its GEMMs.

    python kv_floor.py READ_GB_S zen5/peers_bfloat16_floor.json zen5/peers_float32_floor.json

gemm_floor.py times the projections and the LM head alone. Both engines must also read, for
every decode row, the K and V of the row's whole context from the cache (both keep the cache in
the model's dtype, and a decode-heavy or prefill-heavy batch's cache is hundreds of MB, far past
the L3), so a run cannot take less than (GEMM floor) + (decode K/V bytes) / (read bandwidth).
Prefill rows read their own prompt's K/V, which a tile reads once (counted, small). Not counted:
attention arithmetic, norms, rotary, SiLU, sampling, scheduling, barriers, the vision tower.
Prints, per workload and dtype: the bytes, the combined floor in tok/s (the GEMM floor from the
median panels figure of the run) and its ratio to the run's median vLLM tok/s.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gemm_floor import checkpoint_shapes, kv_read_bytes, workload_lengths  # noqa: E402
from peers import workload_spec  # noqa: E402


def main() -> None:
    read_gb_s = float(sys.argv[1])
    print(f"read bandwidth {read_gb_s:.1f} GB/s")
    print("| workload | dtype | decode K/V read | GEMM floor | GEMM + K/V floor | floor / vLLM | mmkit / vLLM |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in sys.argv[2:]:
        for r in json.loads(Path(path).read_text()):
            spec = workload_spec(r["workload"], r["dtype"])  # the 30-layer checkpoint, as peers.py's default
            shapes, image_tokens = checkpoint_shapes(spec["model"])
            prompts, outs = workload_lengths(spec, image_tokens)
            b = kv_read_bytes(prompts, outs, shapes, 2 if r["dtype"] == "bfloat16" else 4)
            gemm_s = sum(outs) / r["floor_panels_tok_s"]
            both = sum(outs) / (gemm_s + b / (read_gb_s * 1e9))
            print(f"| {r['workload']} | {r['dtype']} | {b / 1e9:.1f} GB | {r['floor_panels_tok_s']:.0f} tok/s "
                  f"({gemm_s:.2f} s) | {both:.0f} tok/s | {both / r['vllm_tok_s']:.2f}x | {r['tok_s_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
