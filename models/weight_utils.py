"""Load llava-hf checkpoints (single file or sharded safetensors) in any of their layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from mmkit.models.checkpoint_keys import KeyMapper, transformers_key_mapper

# Buffers some old checkpoints carry that mmkit recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r} (mmkit loads safetensors only)")
    return files


def iterate_weights(path: Path, key_mapper: KeyMapper) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(checkpoint key, mmkit name, tensor) for every tensor of the checkpoint."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, key_mapper(key), f.get_tensor(key)


def load_weights(model: nn.Module, path: Path, tie_word_embeddings: bool, key_mapper: KeyMapper) -> None:
    """Copy checkpoint tensors into `model` (converting dtype); error on anything missing.

    `key_mapper` turns checkpoint keys into `model`'s names (see checkpoint_keys.py); the
    errors name the keys as the checkpoint spells them."""
    params = dict(model.state_dict(keep_vars=True))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for key, name, tensor in iterate_weights(path, key_mapper):
        target = params.get(name)
        if target is None:
            if not name.endswith(_IGNORED_SUFFIXES):
                unexpected.append(key)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: weight {key!r} has shape {tuple(tensor.shape)} in the checkpoint; the config "
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


def load_vlm_checkpoint(model: nn.Module, path: Path) -> None:
    """Load a vision-language checkpoint into `model` (an mmkit family class named after its
    transformers class, with `config`, `tie_word_embeddings`, `lm_head` and a `language_model`
    decoder): keys renamed by transformers' own conversion list for the class (every layout
    transformers loads), the LM head tied when the config says so, then the decoder's
    projections fused."""
    mapper = transformers_key_mapper(model.config, type(model).__name__)
    load_weights(model, path, model.tie_word_embeddings, mapper)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight
    model.language_model.fuse_weights()
