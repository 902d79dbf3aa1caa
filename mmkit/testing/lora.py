"""Tiny PEFT LoRA adapters for the tests and the benchmark (built offline with PEFT itself)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# Every decoder projection of a Llama-style language model, the LM head and the embeddings.
DECODER_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def build_peft_adapter(base_path: str | Path, out_dir: str | Path, *, seed: int, r: int = 8, lora_alpha: int = 16,
                       target_modules=DECODER_REGEX, **lora_kwargs) -> Path:
    """Save PEFT's LoRA adapter for the checkpoint at `base_path` with random, non-zero A and B
    (`init_lora_weights=False`), seeded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(base_path), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, init_lora_weights=False,
                        **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # smaller deltas: the adapter changes the text, not into noise
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def rewrite_v4_keys(src: str | Path, dst: str | Path, rename) -> Path:
    """A copy of the adapter at `src` whose tensor names pass through `rename` (e.g. the tf5
    `base_model.model.model.language_model.` -> the 4.x `base_model.model.language_model.model.`)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    state = load_file(str(dst / "adapter_model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(dst / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return dst


def edit_adapter_config(path: str | Path, **changes) -> None:
    config_path = Path(path) / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
