"""Round 5: one table from every stage's JSON in this folder (peers.py --json output).

    python summarize.py [FOLDER]

Per workload, shape and dtype: mmkit, vLLM-CPU and vLLM-CPU + zentorch (tok/s, or TPOT/TTFT in
ms for batch1), mmkit over each, and each engine's fraction of the GEMM + K/V floor measured in
the same pair (where the stage ran with --floor), with the parity gates and the pairs run.
"""
import json
import sys
from pathlib import Path


def cell(r: dict, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return fmt.format(r[key] * scale) if key in r else "-"


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    print("| stage | workload | shape | dtype | pairs | mmkit | vLLM | vLLM + zentorch | mmkit / vLLM | "
          "mmkit / zentorch | mmkit / floor | vLLM / floor | zentorch / floor | parity (vLLM, zentorch) |")
    print("| --- " * 14 + "|")
    for path in sorted(folder.glob("*.json")):
        for r in json.loads(path.read_text()):
            pairs = len(r["runs"]["mmkit"])
            keys = [("ttft_s", 1e3), ("tpot_s", 1e3)] if r["workload"] == "batch1" else [("tok_s", 1.0)]
            for key, scale in keys:
                label = r["workload"] + ("" if key == "tok_s" else f" {key[:-2].upper()} (ms)")
                print(f"| {path.stem} | {label} | {r.get('shape', 'toy')} | {r['dtype']} | {pairs} | "
                      f"{cell(r, 'mmkit_' + key, scale)} | {cell(r, 'vllm_' + key, scale)} | "
                      f"{cell(r, 'vllm_zentorch_' + key, scale)} | {cell(r, key + '_ratio', fmt='{:.2f}x')} | "
                      f"{cell(r, key + '_ratio_vllm_zentorch', fmt='{:.2f}x')} | "
                      f"{cell(r, 'mmkit_floor_fraction', 100, '{:.0f}%')} | {cell(r, 'vllm_floor_fraction', 100, '{:.0f}%')} | "
                      f"{cell(r, 'vllm_zentorch_floor_fraction', 100, '{:.0f}%')} | "
                      f"{r.get('parity_identical', '-')}, {r.get('parity_identical_vllm_zentorch', '-')} |")


if __name__ == "__main__":
    main()
