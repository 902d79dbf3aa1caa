"""Peak RSS of loading a model, alone in this process: mmkit's `LLM(model, dtype=...)` or
transformers' `from_pretrained(model, dtype=...)` (model + processor, no requests).

    nice python benchmarks/load_rss.py [--system mmkit|hf] [--dtype bfloat16] [--model DIR]

Without --model it uses (and builds once) the decode-heavy 30-layer benchmark LLaVA. Prints the
RSS after imports, the peak (`VmHWM`) after loading and the RSS then, in MB. Run each system in
its own process: the peak is per process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["mmkit", "hf"], default="mmkit")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--model", help="checkpoint directory (default: the 30-layer decode-heavy benchmark LLaVA)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()

    import torch
    import transformers  # noqa: F401 - both systems import it; counted in the baseline
    import mmkit
    from common import proc_status_mb

    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from bench_model import build_bench_llava

        model = str(build_bench_llava(image_size=96))
    base = proc_status_mb("VmRSS")["VmRSS"]
    if args.system == "mmkit":
        llm = mmkit.LLM(model, dtype=args.dtype)
    else:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        llm = (AutoModelForImageTextToText.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval(),
               AutoProcessor.from_pretrained(model))
    now = proc_status_mb("VmHWM", "VmRSS")
    result = {"system": args.system, "dtype": args.dtype, "model": model, "rss_after_imports_mb": base,
              "peak_rss_mb": max(now["VmHWM"], now["VmRSS"]), "rss_after_load_mb": now["VmRSS"]}
    print(f"{args.system} {args.dtype}: after imports {base:,.0f} MB, peak while loading "
          f"{result['peak_rss_mb']:,.0f} MB, after loading {result['rss_after_load_mb']:,.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    del llm


if __name__ == "__main__":
    main()
