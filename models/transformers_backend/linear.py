"""transformers' `nn.Linear` layers swapped for mmkit's packed `Linear` on CPU.

mmkit's `Linear` (models/llama.py) packs its weight once after loading (mmkit's panels, or
oneDNN's layout) and runs the decode-sized matmuls at up to twice MKL's rate; `F.linear` was
80% of a backend decode step before the swap. transformers' modules call their linears on
`[batch, tokens, hidden]`; `FlatLinear` folds that into the 2-D rows the packed kernels take.
"""

from __future__ import annotations

import torch
from torch import nn

from mmkit.models.llama import Linear


class FlatLinear(Linear):
    """mmkit's `Linear` on inputs of any rank (rows flattened, as `F.linear` treats them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return super().forward(x)
        out = super().forward(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], self.out_features)


def swap_linears(root: nn.Module, release_weights: bool) -> int:
    """Turn every plain `nn.Linear` under `root` into a packed `FlatLinear` (in place; the
    parameters stay the same objects). `release_weights`: drop the row-major copy once packed
    (not for a weight another module shares, e.g. a tied LM head). Returns how many packed."""
    shared = _shared_weights(root)
    count = 0
    for module in root.modules():
        if type(module) is not nn.Linear or not module.weight.is_cpu:
            continue
        module.__class__ = FlatLinear
        module.pack(release_weights and id(module.weight) not in shared)
        count += module._packed is not None
    return count


def _shared_weights(root: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {k for k, n in seen.items() if n > 1}
