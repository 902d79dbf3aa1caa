"""Reading a saved checkpoint folder and writing it back sharded: what every family's
hub-layout rewriter (`rewrite_*_hub_layout`) does around its own key renames."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def read_checkpoint(src: str | Path, dst: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of `src`'s safetensors files; its other files (tokenizer, processor,
    templates) copied into `dst` (created). config.json and the index are the rewriter's to write."""
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def save_sharded(state: dict[str, torch.Tensor], dst: Path, num_shards: int) -> None:
    """`state` as `num_shards` safetensors files with the hub's index file."""
    from safetensors.torch import save_file

    keys = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys[i::num_shards]}, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys[i::num_shards]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
