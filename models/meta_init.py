"""Build a model with its parameters on the meta device and its buffers real.

The model loader (`mmkit/worker/model_loader.py`) builds the model inside `meta_parameters()`;
`weight_utils.load_weights` then creates each parameter once, directly in the engine's
dtype and device, from its checkpoint tensor: loading never holds a float32 copy of the
model next to the checkpoint (for a bf16 engine that copy was twice the final weights).
Buffers (rotary tables, position ids) are computed in `__init__` as before, in the dtype and
on the device of the surrounding context, since nothing in a checkpoint replaces them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch
from torch import nn


# The patch of `nn.Module.register_parameter` is installed while any thread is inside
# `meta_parameters()` and acts only on threads that are: `_local.replaced` is that thread's
# id(real Parameter) -> (weak ref to it, its meta replacement) map, None outside the block.
_local = threading.local()
_lock = threading.Lock()
_users = 0
_original_register = nn.Module.register_parameter


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _original_register(module, name, param)
    replaced: dict[int, tuple[weakref.ref, nn.Parameter]] | None = getattr(_local, "replaced", None)
    if replaced is None or param is None or param.device.type == "meta":
        return
    seen = replaced.get(id(param))
    if seen is not None and seen[0]() is param:  # the same object registered again: share
        meta = seen[1]
    else:
        meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        replaced[id(param)] = (weakref.ref(param), meta)
    module._parameters[name] = meta


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the block, every `nn.Parameter` a module registers is replaced by one of the same
    shape, dtype and `requires_grad` on the meta device (no storage); buffers are untouched.

    Initialisers that modules run on their weights after registering them (`reset_parameters`,
    transformers' `_init_weights`) then act on meta tensors: no compute, no memory. The tensor
    a parameter was created from lives only until the module drops it (one at a time); most are
    `torch.empty` and never touched, so never resident. A Parameter registered twice (shared
    between modules) stays one shared meta Parameter. Only the thread inside the block is
    affected (modules other threads build meanwhile keep real parameters); blocks nest."""
    global _original_register, _users
    with _lock:
        if _users == 0:
            _original_register = nn.Module.register_parameter
            nn.Module.register_parameter = _register_on_meta
        _users += 1
    outer = getattr(_local, "replaced", None)
    _local.replaced = {} if outer is None else outer
    try:
        yield
    finally:
        _local.replaced = outer
        with _lock:
            _users -= 1
            if _users == 0:
                nn.Module.register_parameter = _original_register


def meta_tensor_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(parameter names, buffer names) of `model` still on the meta device."""
    params = [n for n, p in model.named_parameters() if p.is_meta]
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    return params, buffers
