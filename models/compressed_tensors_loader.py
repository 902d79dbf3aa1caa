"""Install compressed-tensors' quantized linear layers while a checkpoint streams.

A quantized module's tensors (checkpoint names `<module>.weight_packed` (int32, packed by
compressed-tensors), `<module>.weight` (int8 for int-quantized, float8_e4m3fn for
float-quantized), `.weight_scale`, `.weight_zero_point`, `.weight_shape`) are collected per
module; `install` unpacks them with compressed-tensors' own `unpack_from_int32` into mmkit's
integer layout (`mmkit/layers/quant_pack.py`) and replaces the meta `Linear` by a
`QuantizedLinear` / `Fp8Linear`. The module's bias is an ordinary parameter and loads as usual.
"""

from __future__ import annotations

import torch
from torch import nn

from mmkit.layers.quant_pack import from_int_values
from mmkit.layers.quantized_linear import Fp8Linear, QuantizedLinear
from mmkit.models.quantization import QuantizationSpec, is_ignored

_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class CompressedTensorsLoader:
    def __init__(self, spec: QuantizationSpec) -> None:
        self.spec = spec
        self.scheme = spec.schemes[0]  # NOTE: one config group (what llm-compressor writes)
        if len({(s.weights.type, s.weights.num_bits) for s in spec.schemes}) != 1:
            raise ValueError("model: compressed-tensors checkpoints with several different schemes are not supported")
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # mmkit module name -> suffix -> tensor
        self.ckpt_names: dict[str, str] = {}  # mmkit module name -> checkpoint module name

    def claims(self, key: str, name: str, tensor: torch.Tensor) -> bool:
        """Whether this checkpoint tensor belongs to a quantized module (then it is kept)."""
        module, _, suffix = name.rpartition(".")
        is_quant = suffix in _SUFFIXES or (suffix == "weight" and module in self.parts)
        if suffix == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn):
            is_quant = True
        if not is_quant:
            return False
        ckpt_module = key.rpartition(".")[0]
        if is_ignored(ckpt_module, self.spec.ignore):
            raise ValueError(f"model: checkpoint tensor {key!r} is quantized, but its module is in the "
                             f"quantization_config's ignore list")
        self.parts.setdefault(module, {})[suffix] = tensor
        self.ckpt_names[module] = ckpt_module
        return True

    def install(self, model: nn.Module, dtype: torch.dtype | None, device) -> list[str]:
        """Replace each collected module; returns the names of the parameters they replace."""
        replaced = []
        for module_name, parts in self.parts.items():
            parent_name, _, attr = module_name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:
                parent = None
            old = getattr(parent, attr, None)
            if not isinstance(old, nn.Linear):  # never dropped: a quantized tensor the model has no layer for
                keys = [f"{self.ckpt_names[module_name]}.{suffix}" for suffix in parts]
                raise ValueError(f"model: checkpoint has quantized weights for a module the model does not have "
                                 f"(or that is not a linear layer): {keys}")
            bias = None if old.bias is None or old.bias.is_meta else old.bias
            if old.bias is not None and old.bias.is_meta:
                raise ValueError(f"model: checkpoint lacks {self.ckpt_names[module_name]}.bias")
            setattr(parent, attr, self._build(module_name, parts, tuple(old.weight.shape), bias, device))
            replaced.append(module_name + ".weight")
        self.parts.clear()
        return replaced

    def _build(self, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, int], bias, device) -> nn.Module:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        w = self.scheme.weights
        where = self.ckpt_names[name]
        if "weight_scale" not in parts:
            raise ValueError(f"model: checkpoint lacks {where}.weight_scale")
        saved_shape = parts.get("weight_shape")
        if saved_shape is not None and tuple(int(v) for v in saved_shape.reshape(-1).tolist()) != shape:
            raise ValueError(f"model: quantized weight {where!r} has weight_shape {saved_shape.tolist()} in the "
                             f"checkpoint; the config implies {list(shape)}")
        scale = parts["weight_scale"].float().reshape(shape[0], -1)  # [N, G]
        if w.type == "float":
            return Fp8Linear(parts["weight"].to(device), scale.to(device), bias,
                             self.scheme.input_activations is not None)
        if "weight_packed" in parts:
            q = unpack_from_int32(parts["weight_packed"], w.num_bits, torch.Size(shape))
        elif "weight" in parts:
            q = parts["weight"]
        else:
            raise ValueError(f"model: checkpoint lacks {where}.weight_packed")
        if tuple(q.shape) != shape:
            raise ValueError(f"model: quantized weight {where!r} has shape {tuple(q.shape)}; the config implies {shape}")
        num_groups = scale.shape[1]
        zp = parts.get("weight_zero_point")
        if zp is not None and zp.dtype == torch.int32 and "weight_packed" in parts:
            zp = unpack_from_int32(zp, w.num_bits, torch.Size((shape[0], num_groups)), packed_dim=0)
        zp = None if zp is None else zp.reshape(shape[0], num_groups).to(torch.int16)
        group_size = shape[1] // num_groups
        q = q.to(torch.int16)
        if w.num_bits == 4:  # signed -8..7 in the checkpoint -> 0..15 with zeros offset by 8
            zeros = (zp if zp is not None else torch.zeros_like(scale, dtype=torch.int16)) + 8
            qw = from_int_values(q + 8, scale, zeros, 4, group_size)
        else:
            qw = from_int_values(q, scale, zp, 8, group_size)
        qw.qweight, qw.scales = qw.qweight.to(device), qw.scales.to(device)
        if qw.zeros is not None:
            qw.zeros = qw.zeros.to(device)
        return QuantizedLinear(qw, bias)
