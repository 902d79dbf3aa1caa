"""Load llava-hf checkpoints (single file or sharded safetensors) in any of their layouts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from mmkit.models.checkpoint_keys import KeyMapper, transformers_key_mapper
from mmkit.models.meta_init import meta_tensor_names
from mmkit.models.quantization import ONLINE_METHODS, OnlineQuantLoader

# Buffers some old checkpoints carry that mmkit recomputes; transformers drops them too
# (`_adjust_missing_and_unexpected_keys`), so they are a warning listing them, not an error.
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
        with _open_safetensors(file) as f:
            for key in f.keys():
                yield key, key_mapper(key), f.get_tensor(key)


def _open_safetensors(file: Path):
    """The file read tensor by tensor with pread(2) where safetensors can (0.8+): a memory map
    keeps every page it has served resident until closed, which put the whole checkpoint on top
    of the loaded model at the peak (the 30-layer benchmark's float32 file: 540 MB)."""
    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # an older safetensors without `backend`
        return safe_open(str(file), framework="pt")


def load_weights(model: nn.Module, path: Path, tied: dict[str, str] | None, key_mapper: KeyMapper,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 quant_loader=None) -> set[str]:
    """Copy checkpoint tensors into `model`; error on anything missing or left over. Returns
    the names of the parameters the checkpoint gave.

    `tied`: {target: source} parameter names the caller ties after loading (the LM head and
    the token embedding); either one may be absent from the checkpoint, not both. Every
    checkpoint tensor is consumed or named in an error, except the buffers transformers drops
    too (`_IGNORED_SUFFIXES`), which are listed in a warning.

    A parameter on the meta device (built under `meta_init.meta_parameters()`) is created here,
    once, in `dtype` and on `device` (default: its own dtype, the CPU), with the values the
    float32 build-then-cast path gives (see `_cast_as_built`); one with storage gets the
    checkpoint tensor copied in (converted to its dtype), as do buffers. `key_mapper` turns
    checkpoint keys into `model`'s names (see checkpoint_keys.py); the errors name the keys as
    the checkpoint spells them. `quant_loader` (a `CompressedTensorsLoader`) takes the tensors of
    quantized modules and replaces those modules after the stream."""
    params = dict(model.state_dict(keep_vars=True))
    holders = _parameter_holders(model)
    materialized: dict[int, nn.Parameter] = {}  # id(meta Parameter) -> its real replacement
    loaded: set[str] = set()
    unexpected: list[str] = []
    ignored: list[str] = []
    # Checkpoint parts transformers skips on load too (Qwen3.5's multi-token-prediction `mtp.*`).
    skipped_prefixes = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
    for key, name, tensor in iterate_weights(path, key_mapper):
        if quant_loader is not None and quant_loader.claims(key, name, tensor):
            continue
        if skipped_prefixes and key.startswith(skipped_prefixes):
            continue
        target = params.get(name)
        if target is None:
            (ignored if name.endswith(_IGNORED_SUFFIXES) else unexpected).append(key)
            continue
        if name in loaded:
            raise ValueError(f"model: checkpoint {str(path)!r} gives {name!r} twice (the last copy is {key!r})")
        # A module may accept another layout of its tensor (MoE experts: the hub's transposed one).
        owner, local_name = holders[id(target)][0]
        adapt = getattr(owner, "checkpoint_tensor", None)
        if adapt is not None:
            tensor = adapt(local_name, tensor)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: weight {key!r} has shape {tuple(tensor.shape)} in the checkpoint; the config "
                f"implies {tuple(target.shape)}"
            )
        target = materialized.get(id(target), target)  # a shared Parameter already created
        with torch.no_grad():
            if target.is_meta:
                real = _materialize(target, tensor, dtype, device)
                materialized[id(target)] = real
                for module, local_name in holders[id(target)]:
                    module._parameters[local_name] = real
            else:
                target.data.copy_(tensor.to(target.dtype))
        loaded.add(name)
    if quant_loader is not None:
        loaded.update(quant_loader.install(model, dtype, device))
    missing = [n for n in params if n not in loaded and not n.endswith(_IGNORED_SUFFIXES)]
    for target_name, source_name in (tied or {}).items():  # one of the pair is enough (tied after loading)
        if target_name in loaded or source_name in loaded:
            missing = [n for n in missing if n not in (target_name, source_name)]
    if missing:
        raise ValueError(f"model: checkpoint {str(path)!r} lacks {len(missing)} weights, e.g. {missing[:5]}")
    if unexpected:
        raise ValueError(
            f"model: checkpoint {str(path)!r} has {len(unexpected)} unexpected weights (the model does not use them): "
            f"{unexpected[:20]}"
            + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        )
    if ignored:
        warnings.warn(f"model: checkpoint {str(path)!r} has {len(ignored)} buffers mmkit recomputes (transformers "
                      f"ignores them too), not loaded: {ignored[:20]}", stacklevel=3)
    return loaded


def _parameter_holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(Parameter) -> every (module, attribute name) holding it (a shared one has several)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for local_name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, local_name))
    return holders


def _materialize(meta: nn.Parameter, tensor: torch.Tensor, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> nn.Parameter:
    """A real Parameter for the meta one, in `dtype` (floating parameters only) on `device`."""
    built = meta.dtype
    target_dtype = dtype if dtype is not None and built.is_floating_point else built
    real = torch.empty(meta.shape, dtype=target_dtype, device=device or "cpu")
    real.copy_(_cast_as_built(tensor, built))
    return nn.Parameter(real, requires_grad=meta.requires_grad)


_EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)  # every value a float32 holds


def _cast_as_built(tensor: torch.Tensor, built: torch.dtype) -> torch.Tensor:
    """`tensor` rounded as the build-then-cast path rounded it: checkpoint -> the dtype the
    parameter was built in -> the engine dtype. When the parameter was built in float32 and the
    checkpoint is float32/bf16/fp16, the first step is exact (every bf16/fp16 value is a
    float32), so casting straight to the engine dtype rounds identically and no float32 copy
    is made; otherwise (a float64 checkpoint, a tower transformers built in its config's half
    dtype) the intermediate cast is kept, one tensor at a time."""
    if tensor.dtype == built or (built == torch.float32 and tensor.dtype in _EXACT_IN_FLOAT32):
        return tensor
    return tensor.to(built)


def transformers_class_name(model_cls: type) -> str:
    """The transformers model class whose checkpoints `model_cls` loads: the nearest class in
    its MRO named like one (an out-of-tree subclass registered under another name loads its
    base family's checkpoints), or `model_cls.hf_class_name` when the family sets it."""
    import transformers

    declared = getattr(model_cls, "hf_class_name", None)
    if declared:
        return declared
    for cls in model_cls.__mro__:
        if isinstance(getattr(transformers, cls.__name__, None), type):
            return cls.__name__
    raise ValueError(f"model: {model_cls.__qualname__} derives from no transformers model class; set its "
                     "`hf_class_name` to the transformers class whose checkpoint keys it loads")


def load_vlm_checkpoint(model: nn.Module, path: Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> None:
    """Load a vision-language checkpoint into `model` (an mmkit family class named after its
    transformers class, with `config`, `tie_word_embeddings`, `lm_head` and a `language_model`
    decoder): keys renamed by transformers' own conversion list for the class (every layout
    transformers loads), the LM head tied as transformers ties it (`_tie_embeddings`; the
    model's `tie_word_embeddings` then says whether it is), then the decoder's
    projections fused. Meta parameters are created in `dtype` on `device` (`load_weights`)."""
    mapper = transformers_key_mapper(model.config, transformers_class_name(type(model)))
    spec = getattr(model, "quantization", None)  # set by the model loader (models/quantization.py)
    quant_loader = None
    if spec is not None and spec.method == "compressed-tensors":
        from mmkit.models.compressed_tensors_loader import CompressedTensorsLoader

        quant_loader = CompressedTensorsLoader(spec)
    elif spec is not None and spec.method in ONLINE_METHODS:
        quant_loader = OnlineQuantLoader(spec, model)
    head = _parameter_name(model, model.lm_head.weight)
    embed = _parameter_name(model, model.language_model.embed_tokens.weight)
    tied = {head: embed} if model.tie_word_embeddings else None
    loaded = load_weights(model, path, tied, mapper, dtype, device, quant_loader)
    if model.tie_word_embeddings:
        model.tie_word_embeddings = _tie_embeddings(model, head in loaded, embed in loaded)
    params, buffers = meta_tensor_names(model)
    if params or buffers:  # pragma: no cover - load_weights names missing weights first
        names = params + buffers
        raise ValueError(f"model: checkpoint {str(path)!r} lacks {len(names)} weights, e.g. {names[:5]}")
    model.language_model.fuse_weights()


def _parameter_name(model: nn.Module, param: nn.Parameter) -> str:
    return next(name for name, p in model.named_parameters(remove_duplicate=False) if p is param)


def _tie_embeddings(model: nn.Module, has_head: bool, has_embed: bool) -> bool:
    """transformers' `tie_weights` at load time, for a config that asks for tying: the LM head
    becomes the token embedding; the one the checkpoint lacks takes the other's tensor (it may
    hold only the head); both present with different values: NOT tied, a warning (the
    checkpoint's own head is used, never dropped). Returns whether they are tied."""
    head, embed = model.lm_head.weight, model.language_model.embed_tokens.weight
    if has_head and has_embed and not torch.equal(head, embed):
        warnings.warn("model: the config ties the LM head to the token embedding (tie_word_embeddings), but the "
                      "checkpoint holds both with different values: not tied, as transformers does", stacklevel=3)
        return False
    if has_head and not has_embed:
        model.language_model.embed_tokens.weight = head
    else:
        model.lm_head.weight = embed
    return True
