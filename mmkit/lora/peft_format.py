"""PEFT's saved LoRA format -> per-module A/B tensors under mmkit's module names.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules as a list
or a regex, exclude_modules, rank_pattern / alpha_pattern) and `adapter_model.safetensors`
(or `adapter_model.bin`) with `<module>.lora_A.weight` [r, in], `<module>.lora_B.weight`
[out, r] and, for embeddings, `<module>.lora_embedding_A` [r, vocab] / `lora_embedding_B`
[hidden, r]. The tensor names are the truth (the config's patterns only filter them); they
come in the layout transformers 5 saves (`base_model.model.model.language_model.layers.*`) or
in the 4.x one hub adapters carry (`base_model.model.language_model.model.layers.*`, Qwen-VL's
`base_model.model.model.layers.*`); `canonical_name` maps both to the names of mmkit's modules.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Prefix rewrites, tried in order, from HF module paths (either layout) to mmkit's.
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head", "lm_head"),
    ("model.vision_tower.", "vision_tower."),
    ("model.visual.", "visual."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.", "language_model."),  # 4.x Qwen-VL / plain decoders: model.layers.*, model.embed_tokens
)
# mmkit's top-level parts that belong to the vision side (enable_tower_connector_lora).
TOWER_PREFIXES = ("vision_tower.", "visual.", "multi_modal_projector.", "vision_model.", "mm_projector.")


def canonical_name(module_path: str) -> str:
    """`base_model.model.model.language_model.layers.0.self_attn.q_proj` ->
    `language_model.layers.0.self_attn.q_proj` (the 4.x and tf5 layouts give the same name)."""
    name = module_path.removeprefix("base_model.model.")
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def is_tower_module(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES)


@dataclass
class LoRAModuleWeights:
    """One module's low-rank pair: delta = (x @ a.T) @ b.T * scale (embeddings: a is [vocab, r])."""

    a: torch.Tensor  # [r, in] (embedding: [vocab, r], i.e. lora_embedding_A transposed)
    b: torch.Tensor  # [out, r]
    scale: float
    is_embedding: bool = False

    @property
    def rank(self) -> int:
        return self.b.shape[1]


@dataclass
class PeftAdapter:
    path: str
    rank: int  # the largest module rank
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)  # by canonical name
    num_bytes: int = 0
    target_list: list[str] = field(default_factory=list)  # the config's target_modules when a list


def _read_config(path: Path) -> dict:
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"lora_path: {str(path)!r} holds no adapter_config.json (expected a PEFT LoRA adapter "
                         "saved by save_pretrained)")
    config = json.loads(config_path.read_text())
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"lora_path: {str(path)!r} is a {peft_type} adapter; only LoRA adapters are supported")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if config.get(key):
            raise ValueError(f"lora_path: {str(path)!r} uses {what} ({key}=true), which mmkit does not support")
    if config.get("modules_to_save"):
        raise ValueError(f"lora_path: {str(path)!r} saves whole modules {config['modules_to_save']} "
                         "(modules_to_save); mmkit serves LoRA deltas only")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    bin_path = path / "adapter_model.bin"
    if bin_path.is_file():
        return torch.load(str(bin_path), map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path: {str(path)!r} holds no adapter_model.safetensors (or adapter_model.bin)")


def _matches(patterns, module_path: str) -> bool:
    """PEFT's rule: a regex string must match the whole path; a list entry matches the path or
    its dotted suffix."""
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, module_path) is not None
    return any(module_path == p or module_path.endswith("." + p) for p in patterns)


def _pattern_value(patterns: dict, module_path: str, default):
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def load_peft_adapter(lora_path: str) -> PeftAdapter:
    """Read a PEFT LoRA folder; ValueError naming the path and the cause when it is not one."""
    path = Path(lora_path).expanduser()
    if not lora_path or not path.exists():
        raise ValueError(f"lora_path: {lora_path!r} does not exist (expected a folder saved by PEFT's save_pretrained)")
    if not path.is_dir():
        raise ValueError(f"lora_path: {lora_path!r} is a file; expected a PEFT adapter folder")
    config = _read_config(path)
    tensors = _read_tensors(path)
    r = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", r))
    use_rslora = bool(config.get("use_rslora", False))
    exclude = config.get("exclude_modules")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for suffix, role in ((".lora_A.weight", "A"), (".lora_B.weight", "B"),
                             (".lora_embedding_A", "EA"), (".lora_embedding_B", "EB")):
            if key.endswith(suffix):
                module = key[:-len(suffix)]
                # PEFT may name the adapter inside the key (`lora_A.default.weight`): handled by the
                # suffix rules above only for the default save; strip a named one here.
                pairs.setdefault(module, {})[role] = tensor
                break
        else:
            named = re.match(r"(.*)\.(lora_A|lora_B)\.[^.]+\.weight$", key)
            if named:
                pairs.setdefault(named.group(1), {})["A" if named.group(2) == "lora_A" else "B"] = tensor
            # other tensors (`*.base_layer.weight`: PEFT's copy of a targeted embedding/LM head) are
            # the base model's own weights; resized vocabularies are refused by the manager (shapes).
    adapter = PeftAdapter(path=str(path), rank=0)
    for module, parts in sorted(pairs.items()):
        hf_path = module.removeprefix("base_model.model.")
        if exclude is not None and _matches(exclude, hf_path):
            continue
        module_r = int(_pattern_value(config.get("rank_pattern"), hf_path, r))
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), hf_path, alpha))
        if "EA" in parts or "EB" in parts:
            if "EA" not in parts or "EB" not in parts:
                raise ValueError(f"lora_path: {lora_path!r}: module {hf_path!r} has only one of lora_embedding_A/B")
            a, b, is_emb = parts["EA"].t(), parts["EB"], True
        else:
            if "A" not in parts or "B" not in parts:
                raise ValueError(f"lora_path: {lora_path!r}: module {hf_path!r} has only one of lora_A/lora_B")
            a, b, is_emb = parts["A"], parts["B"], False
        rank = b.shape[1]
        if rank != module_r and not config.get("rank_pattern"):
            module_r = rank  # the tensors are the truth
        scale = module_alpha / math.sqrt(module_r) if use_rslora else module_alpha / module_r
        weights = LoRAModuleWeights(a.contiguous(), b.contiguous(), scale, is_emb)
        adapter.modules[canonical_name(hf_path)] = weights
        adapter.rank = max(adapter.rank, rank)
        adapter.num_bytes += a.numel() * a.element_size() + b.numel() * b.element_size()
    if not adapter.modules:
        raise ValueError(f"lora_path: {lora_path!r} holds no LoRA weights (no lora_A/lora_B tensors)")
    targets = config.get("target_modules")
    adapter.target_list = list(targets) if isinstance(targets, (list, tuple, set)) else []
    return adapter
