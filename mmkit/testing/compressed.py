"""Quantize a saved tiny checkpoint data-free with compressed-tensors' own code.

What llm-compressor's data-free path does, minus llm-compressor: the scheme is attached to the
transformers model (`apply_quantization_config`), each quantized Linear gets its weight's
scale / zero point from its own min and max (`calculate_qparams`: a min-max observer, no
calibration data), then `ModelCompressor` packs the weights into the chosen format and the
checkpoint is saved with its `quantization_config`. The result is what a user downloads as
`...-quantized.w4a16`, `...-quantized.w8a16` or `...-FP8-dynamic`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

# scheme name (compressed-tensors' presets) -> the format llm-compressor saves it in
DEFAULT_FORMATS = {"W4A16": "pack-quantized", "W4A16_ASYM": "pack-quantized", "W8A16": "pack-quantized",
                   "FP8": "float-quantized", "FP8_DYNAMIC": "float-quantized"}


def _observe_weight(module: torch.nn.Module) -> None:
    """Set `weight_scale` (and `weight_zero_point`) from the weight's min/max per the scheme."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach().float()
    if args.strategy == "group":
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [out, groups]
    elif args.strategy == "channel":
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)  # [out, 1]
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        zp = zero_point.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
        module.weight_zero_point.data = zp


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str = "W4A16", fmt: str | None = None,
                        ignore: Sequence[str] = ("lm_head", "re:.*vision.*", "re:.*multi_modal_projector.*",
                                                 "re:.*merger.*"),
                        targets: Sequence[str] = ("Linear",), group_size: int = 32,
                        keep_regex_ignore: bool = False) -> Path:
    """Save `src` (an unquantized tiny checkpoint) quantized with compressed-tensors preset
    `scheme` into `dst` in `fmt` (default: the format llm-compressor uses for the scheme).
    `ignore` takes both forms compressed-tensors accepts: `re:` regexes and module names.
    `group_size` replaces the preset's (128) for grouped schemes: tiny models are 64 wide; W8A16
    is saved per output channel (what the issue's users download). compressed-tensors expands
    `ignore` into explicit module names when saving; `keep_regex_ignore` writes the given list
    back (the form llm-compressor recipes leave in many released configs)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)

    src, dst = Path(src), Path(dst)
    config = transformers.AutoConfig.from_pretrained(src)
    model_cls = getattr(transformers, config.architectures[0])
    model = model_cls.from_pretrained(src, dtype=torch.float32).eval()
    qscheme = preset_name_to_scheme(scheme, list(targets))
    if scheme == "W8A16":
        qscheme.weights.strategy, qscheme.weights.group_size = "channel", None
    elif qscheme.weights is not None and qscheme.weights.strategy == "group":
        qscheme.weights.group_size = group_size
    qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore),
                                 quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, qconfig)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None and module.quantization_scheme.weights:
            _observe_weight(module)
    compressor = ModelCompressor.from_pretrained_model(model, fmt or DEFAULT_FORMATS[scheme])
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    if keep_regex_ignore:
        config_file = dst / "config.json"
        saved = json.loads(config_file.read_text())
        saved["quantization_config"]["ignore"] = list(ignore)
        config_file.write_text(json.dumps(saved, indent=2))
    for extra in src.iterdir():  # tokenizer, processor and chat template files
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json") \
                and extra.is_file() and not (dst / extra.name).exists():
            (dst / extra.name).write_bytes(extra.read_bytes())
    return dst
