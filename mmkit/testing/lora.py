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


def write_random_adapter(out_dir: str | Path, shapes: dict[str, tuple[int, int]], *, seed: int, r: int = 8,
                         lora_alpha: int = 16, std: float = 0.02) -> Path:
    """A PEFT-format adapter written directly (no model load): `shapes` maps each module's path in
    transformers 5's naming (`model.language_model.layers.0.self_attn.q_proj`) to (in, out)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in shapes.items():
        state[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * std
        state[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * std
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    leaves = sorted({n.rsplit(".", 1)[-1] for n in shapes})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "target_modules": leaves, "use_rslora": False}))
    return out


def decoder_shapes(text_config) -> dict[str, tuple[int, int]]:
    """Every attention and MLP projection of a Llama-style decoder (transformers 5 names)."""
    h, inter = text_config.hidden_size, text_config.intermediate_size
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or h // heads
    kv = (getattr(text_config, "num_key_value_heads", None) or heads) * head_dim
    shapes = {}
    for i in range(text_config.num_hidden_layers):
        p = f"model.language_model.layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj": (h, heads * head_dim), f"{p}.self_attn.k_proj": (h, kv),
                       f"{p}.self_attn.v_proj": (h, kv), f"{p}.self_attn.o_proj": (heads * head_dim, h),
                       f"{p}.mlp.gate_proj": (h, inter), f"{p}.mlp.up_proj": (h, inter),
                       f"{p}.mlp.down_proj": (inter, h)})
    return shapes
