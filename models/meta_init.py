"""Build a model with its parameters on the meta device and its buffers real.

The model runner builds the model inside `meta_parameters()` and the loader
(`weight_utils.load_weights`) then creates each parameter once, directly in the engine's
dtype and device, from its checkpoint tensor: loading never holds a float32 copy of the
model next to the checkpoint (for a bf16 engine that copy was twice the final weights).
Buffers (rotary tables, position ids) are computed in `__init__` as before, in the dtype and
on the device of the surrounding context, since nothing in a checkpoint replaces them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the block, every `nn.Parameter` a module registers is replaced by one of the same
    shape, dtype and `requires_grad` on the meta device (no storage); buffers are untouched.

    Initialisers that modules run on their weights after registering them (`reset_parameters`,
    transformers' `_init_weights`) then act on meta tensors: no compute, no memory. The tensor
    a parameter was created from lives only until the module drops it (one at a time); most are
    `torch.empty` and never touched, so never resident. A Parameter registered twice (shared
    between modules) stays one shared meta Parameter. Not thread-safe (patches `nn.Module`)."""
    original = nn.Module.register_parameter
    # id(real Parameter) -> (weak ref to it, its meta replacement): one replacement per object.
    replaced: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.device.type == "meta":
            return
        seen = replaced.get(id(param))
        if seen is not None and seen[0]() is param:
            meta = seen[1]
        else:
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            replaced[id(param)] = (weakref.ref(param), meta)
        module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def meta_tensor_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(parameter names, buffer names) of `model` still on the meta device."""
    params = [n for n, p in model.named_parameters() if p.is_meta]
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    return params, buffers
