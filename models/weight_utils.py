"""Load llava-hf checkpoints (single file or sharded safetensors) in any of their layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

_TOP_LEVEL = ("vision_tower.", "multi_modal_projector.", "language_model.", "lm_head.")
# Buffers some old checkpoints carry that mmkit recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids")


def normalize_key(key: str) -> str:
    """Map every llava-hf naming onto mmkit's module names.

    hub (transformers 4.x): `language_model.model.layers.0...`, `language_model.lm_head.weight`
    transformers 5:         `model.language_model.layers.0...`, `lm_head.weight`
    """
    while True:
        if key.startswith("model.") and key[len("model."):].startswith(_TOP_LEVEL):
            key = key[len("model."):]
        elif key.startswith("language_model.model."):
            key = "language_model." + key[len("language_model.model."):]
        elif key.startswith("language_model.lm_head."):
            key = key[len("language_model."):]
        else:
            return key


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r} (mmkit loads safetensors only)")
    return files


def iterate_weights(path: Path, normalize=normalize_key) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield normalize(key), f.get_tensor(key)


def load_weights(model: nn.Module, path: Path, tie_word_embeddings: bool, normalize=normalize_key) -> None:
    """Copy checkpoint tensors into `model` (converting dtype); error on anything missing.
    `normalize` maps checkpoint names onto the model's (the family's key layouts)."""
    params = dict(model.state_dict(keep_vars=True))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iterate_weights(path, normalize):
        target = params.get(name)
        if target is None:
            if not name.endswith(_IGNORED_SUFFIXES):
                unexpected.append(name)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint; the config "
                f"implies {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.data.copy_(tensor.to(target.dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not n.endswith(_IGNORED_SUFFIXES)]
    if tie_word_embeddings or "lm_head.weight" not in loaded:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"model: checkpoint {str(path)!r} lacks {len(missing)} weights, e.g. {missing[:5]}")
    if unexpected:
        raise ValueError(
            f"model: checkpoint {str(path)!r} has {len(unexpected)} unexpected weights, e.g. {unexpected[:5]}"
        )
