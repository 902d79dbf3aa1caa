"""Quantized checkpoints and online weight-only quantization: what is supported, checked before
any weight is read, and the decoder-linear replacement.

- `QuantizationSpec.from_config(hf_config, quantization, quantization_config)` reads a checkpoint's
  `quantization_config` (compressed-tensors only; its `QuantizationConfig` parses it) or the
  user's online method ("int8" / "int4"); anything else is a `ValueError` naming what was
  found and what is supported.
- `CompressedTensorsLoader` collects a quantized module's tensors while the checkpoint streams
  (`weight_packed` / int8 `weight` / fp8 `weight`, `weight_scale`, `weight_zero_point`) and
  installs a `QuantizedLinear` / `Fp8Linear` in place of the meta `Linear`; integers stay integer.
- `OnlineQuantLoader` quantizes the decoder's linears (q/k/v/o and gate/up/down) online, tensor
  by tensor as the checkpoint streams; `quantize_decoder_linears` does the same on a loaded model
  (any Linear under `language_model.layers` still unquantized: fused or not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
ONLINE_METHODS = ("int8", "int4")
_SUPPORTED = (f"supported: compressed-tensors checkpoints in {', '.join(SUPPORTED_FORMATS)} (W4A16, W8A16, "
              f"FP8-dynamic), or quantization={list(ONLINE_METHODS)} on an unquantized checkpoint")
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


@dataclass(frozen=True)
class QuantizationSpec:
    method: str  # "compressed-tensors", "int8", "int4"
    group_size: int = 32  # online int4
    ignore: tuple[str, ...] = ()  # compressed-tensors: names / "re:" regexes kept unquantized
    schemes: tuple[Any, ...] = field(default=(), compare=False)  # compressed-tensors QuantizationScheme

    @staticmethod
    def from_config(hf_config: Any, quantization: str | None,
                    quantization_config: dict | None) -> "QuantizationSpec | None":
        saved = getattr(hf_config, "quantization_config", None)
        if saved is not None:
            if quantization is not None:
                raise ValueError(f"quantization: got {quantization!r} for a checkpoint that is already quantized "
                                 f"({_method_of(saved)!r}); expected None")
            return _compressed_tensors_spec(saved if isinstance(saved, dict) else saved.to_dict())
        if quantization is None:
            return None
        if quantization not in ONLINE_METHODS:
            raise ValueError(f"quantization: got {quantization!r}; expected one of {list(ONLINE_METHODS)} or None")
        extra = dict(quantization_config or {})
        group_size = extra.pop("group_size", 32)
        if extra:
            raise ValueError(f"quantization_config: unknown keys {sorted(extra)}; expected only 'group_size'")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"quantization_config: group_size {group_size!r}; expected a positive integer")
        return QuantizationSpec(quantization, group_size=group_size)


def _method_of(saved: Any) -> str:
    d = saved if isinstance(saved, dict) else getattr(saved, "to_dict", lambda: {})()
    return str(d.get("quant_method", "unknown"))


def _compressed_tensors_spec(saved: dict) -> QuantizationSpec:
    method = saved.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"model: the checkpoint's quantization_config has quant_method {method!r}, which mmkit "
                         f"does not load; {_SUPPORTED}")
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as exc:
        raise ValueError("model: this checkpoint is quantized with compressed-tensors; install it with "
                         "from a clone: pip install -e '.[quant]'") from exc

    for name, group in (saved.get("config_groups") or {}).items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") == "group":
            raise ValueError(f"model: compressed-tensors config group {name!r}: GPTQ act-order 'group' (weights "
                             f"permuted by g_idx) is not supported; {_SUPPORTED}")
    try:
        config = QuantizationConfig.model_validate(saved)
    except ValueError as exc:  # pydantic's ValidationError: a scheme this compressed-tensors rejects
        raise ValueError(f"model: the checkpoint's compressed-tensors quantization_config is not valid "
                         f"({str(exc).splitlines()[0]}); {_SUPPORTED}") from exc
    if config.kv_cache_scheme is not None:
        raise ValueError(f"model: compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported; {_SUPPORTED}")
    schemes = []
    for name, scheme in config.config_groups.items():
        fmt = scheme.format or config.format
        where = f"model: compressed-tensors config group {name!r}"
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"{where} has format {fmt!r}; {_SUPPORTED}")
        w = scheme.weights
        if w is None or scheme.output_activations is not None:
            raise ValueError(f"{where}: only weight quantization (with dynamic FP8 activations) is supported; {_SUPPORTED}")
        if w.type == "int":
            if w.num_bits not in (4, 8) or w.strategy not in ("group", "channel"):
                raise ValueError(f"{where}: int{w.num_bits} weights with strategy {w.strategy!r}; expected int4/int8 "
                                 f"per group or channel; {_SUPPORTED}")
            if w.actorder not in (None, "static", "weight"):
                raise ValueError(f"{where}: GPTQ act-order {w.actorder!r} (weights permuted by g_idx) is not "
                                 f"supported; {_SUPPORTED}")
            if scheme.input_activations is not None:
                raise ValueError(f"{where}: quantized activations with int weights (W{w.num_bits}A"
                                 f"{scheme.input_activations.num_bits}) are not supported; {_SUPPORTED}")
        elif w.type == "float":
            if w.num_bits != 8 or w.strategy not in ("channel", "tensor"):
                raise ValueError(f"{where}: float{w.num_bits} weights with strategy {w.strategy!r} (block scales, "
                                 f"NVFP4/MXFP4) are not supported; expected FP8 per channel or tensor; {_SUPPORTED}")
            act = scheme.input_activations
            if act is not None and not (act.type == "float" and act.dynamic is True and act.strategy == "token"):
                raise ValueError(f"{where}: FP8 activations must be dynamic per token (got {act.strategy!r}, "
                                 f"dynamic={act.dynamic}); {_SUPPORTED}")
        else:
            raise ValueError(f"{where}: weight type {w.type!r}; {_SUPPORTED}")
        schemes.append(scheme)
    return QuantizationSpec("compressed-tensors", ignore=tuple(config.ignore or ()), schemes=tuple(schemes))


def is_ignored(module_name: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' two forms: "re:<regex>" (matched from the start) and module names."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module_name):
                return True
        elif module_name == entry or module_name.endswith("." + entry):
            return True
    return False


def quantize_decoder_linears(model: nn.Module, spec: QuantizationSpec) -> int:
    """Online int8/int4 of every Linear in `model.language_model.layers`; returns how many."""
    from mmkit.layers.quant_pack import quantize_int4, quantize_int8
    from mmkit.layers.quantized_linear import QuantizedLinear

    count = 0
    for layer in model.language_model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    w = child.weight.detach()
                    qw = quantize_int8(w) if spec.method == "int8" else quantize_int4(w, spec.group_size)
                    setattr(parent, name, QuantizedLinear(_to_device(qw, w.device), child.bias))
                    count += 1
    return count


class OnlineQuantLoader:
    """Online int8/int4 while the checkpoint streams (the `load_weights` quant-loader interface,
    as `CompressedTensorsLoader`): each decoder linear's weight is quantized from the checkpoint
    tensor itself (float32 formula, exact for float32/bf16/fp16 checkpoints) as it is read, so
    the engine-dtype copy of the decoder's linears never exists: the load peaks at the quantized
    model plus one tensor instead of the whole unquantized model."""

    def __init__(self, spec: QuantizationSpec, model: nn.Module) -> None:
        self.spec = spec
        self.shapes = {f"language_model.layers.{i}.{name}": tuple(m.weight.shape)
                       for i, layer in enumerate(model.language_model.layers)
                       for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        self.weights: dict[str, Any] = {}  # module name -> QuantizedWeight

    def claims(self, key: str, name: str, tensor) -> bool:
        from mmkit.layers.quant_pack import quantize_int4, quantize_int8

        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or module not in self.shapes:
            return False
        if tuple(tensor.shape) != self.shapes[module]:
            raise ValueError(f"model: weight {key!r} has shape {tuple(tensor.shape)} in the checkpoint; the config "
                             f"implies {self.shapes[module]}")
        self.weights[module] = quantize_int8(tensor) if self.spec.method == "int8" else \
            quantize_int4(tensor, self.spec.group_size)
        return True

    def install(self, model: nn.Module, dtype, device) -> list[str]:
        """Replace each quantized module (its bias, if any, is loaded by now)."""
        from mmkit.layers.quantized_linear import QuantizedLinear

        for module_name, qw in self.weights.items():
            parent_name, _, attr = module_name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
            if old.bias is not None and old.bias.is_meta:
                raise ValueError(f"model: checkpoint lacks the bias of {module_name}")
            setattr(parent, attr, QuantizedLinear(_to_device(qw, device or "cpu"), old.bias))
        replaced = [n + ".weight" for n in self.weights]
        self.weights.clear()
        return replaced


def _to_device(qw, device):
    qw.qweight, qw.scales = qw.qweight.to(device), qw.scales.to(device)
    if qw.zeros is not None:
        qw.zeros = qw.zeros.to(device)
    return qw


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(every weight held, the decoder's linear layers' weights): parameters (shared ones once)
    plus quantized layers' integers, scales and zero points."""
    seen: set[int] = set()
    total = decoder = 0
    decoder_modules = {id(m) for m in model.language_model.layers.modules()} if hasattr(model, "language_model") else set()
    for module in model.modules():
        own = 0
        if hasattr(module, "weight_nbytes") and not isinstance(module, nn.Linear):
            own = module.weight_nbytes()
            for p in module.parameters(recurse=False):
                seen.add(p.data_ptr())
        else:
            for p in module.parameters(recurse=False):
                if p.data_ptr() in seen or p.numel() == 0:
                    continue
                seen.add(p.data_ptr())
                own += p.numel() * p.element_size()
            for name in ("_packed", "_onednn"):  # packed copies (the row-major one may be released)
                packed = getattr(module, name, None)
                if packed is not None:
                    own += packed.numel() * packed.element_size()
        total += own
        if id(module) in decoder_modules and (isinstance(module, nn.Linear) or hasattr(module, "weight_nbytes")):
            decoder += own
    return total, decoder
