"""Quantized weights: compressed-tensors checkpoints and online int8/int4 (float32 greedy ids
identical to transformers), the decoder-linear byte ratios, the errors before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmkit import LLM, SamplingParams
from mmkit.layers.quant_pack import quantize_int4, quantize_int8
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.compressed import quantize_checkpoint

TEXT = "a small cat sat on the mat"
NUM_TOKENS = 10
ARCHS = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {name: build_tiny_checkpoint(arch, root / name) for name, arch in ARCHS.items()}


def _prompt(path) -> list[int]:
    """Ordinary text tokens of the checkpoint's tokenizer (ids below its special tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(TEXT, add_special_tokens=False)["input_ids"]


def _mmkit_ids(path, **kw) -> tuple[list[int], dict]:
    llm = LLM(str(path), dtype="float32", seed=0, **kw)
    out = llm.generate({"prompt_token_ids": _prompt(path)}, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                      ignore_eos=True))
    return list(out[0].outputs[0].token_ids), llm.get_metrics()


def _hf_model(path, **kw):
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32, **kw).eval()


def _hf_ids(model, path) -> list[int]:
    prompt = _prompt(path)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def _add_dynamic_fp8_inputs(hf, path) -> None:
    """transformers' dequantized load drops the activation scheme (and its compressed CPU path
    cannot run FP8), so the reference quantizes each quantized Linear's input per token with
    compressed-tensors' own functions, as its forward does."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from mmkit.models.quantization import is_ignored

    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs.model_validate(qc["config_groups"]["group_0"]["input_activations"])

    def hook(module, inputs):
        x = inputs[0]
        scale, zp = compute_dynamic_scales_and_zp(x, args, module)
        return (fake_quantize(x, scale, zp, args),)

    for name, module in hf.named_modules():
        ckpt_name = name.replace("model.language_model.", "language_model.model.")
        if isinstance(module, torch.nn.Linear) and "language_model.layers" in name and not is_ignored(ckpt_name, tuple(qc["ignore"])):
            module.register_forward_pre_hook(hook)


CASES = [("W4A16", None), ("W4A16_ASYM", None), ("W8A16", "pack-quantized"), ("W8A16", "int-quantized"),
         ("FP8_DYNAMIC", None)]


@pytest.mark.parametrize("family", list(ARCHS))
@pytest.mark.parametrize("scheme,fmt", CASES)
def test_compressed_tensors_matches_transformers(bases, tmp_path, family, scheme, fmt):
    from transformers import CompressedTensorsConfig

    regex = scheme == "W4A16"  # the `re:` form of `ignore` (the others keep the saved names)
    path = quantize_checkpoint(bases[family], tmp_path / scheme, scheme, fmt, keep_regex_ignore=regex)
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert any(e.startswith("re:") for e in ignore) == regex
    ids, metrics = _mmkit_ids(path)
    hf = _hf_model(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    if scheme == "FP8_DYNAMIC":
        _add_dynamic_fp8_inputs(hf, path)
    assert ids == _hf_ids(hf, path)
    _, base_metrics = _mmkit_ids(bases[family])
    ratio = metrics["decoder_linear_weight_bytes"] / base_metrics["decoder_linear_weight_bytes"]
    if scheme != "FP8_DYNAMIC":
        assert ratio <= 0.27, ratio


def test_ignored_modules_stay_float(bases, tmp_path):
    from mmkit.layers.quantized_linear import QuantizedLinear

    path = quantize_checkpoint(bases["llava"], tmp_path / "w4", "W4A16", keep_regex_ignore=True)
    llm = LLM(str(path), dtype="float32")
    model = llm.llm_engine.model_runner.model
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(n.startswith("language_model.layers.") for n in quantized)


@pytest.mark.parametrize("family", list(ARCHS))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_online_matches_round_trip(bases, family, method):
    ids, metrics = _mmkit_ids(bases[family], quantization=method)
    hf = _hf_model(bases[family])
    with torch.no_grad():
        for layer in hf.model.language_model.layers:
            for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
                q = quantize_int8(lin.weight) if method == "int8" else quantize_int4(lin.weight, 32)
                lin.weight.copy_(q.dequantize())
    assert ids == _hf_ids(hf, bases[family])
    _, base = _mmkit_ids(bases[family])
    ratio = metrics["decoder_linear_weight_bytes"] / base["decoder_linear_weight_bytes"]
    assert ratio <= (0.27 if method == "int8" else 0.17), ratio
    assert metrics["model_weight_bytes"] < base["model_weight_bytes"]


def test_online_quantizes_checkpoint_tensors_as_they_stream(bases, monkeypatch):
    """bf16 engine, float32 checkpoint: each decoder linear is quantized from the checkpoint's
    float32 tensor (not from a bf16-rounded copy), while the weights stream."""
    from safetensors.torch import load_file

    import mmkit.worker.model_loader as loader
    from mmkit.layers.quantized_linear import QuantizedLinear

    path = bases["llava"]
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    calls = []
    after_load = loader.quantize_decoder_linears
    monkeypatch.setattr(loader, "quantize_decoder_linears", lambda m, spec: calls.append(after_load(m, spec)))
    llm = LLM(str(path), dtype="bfloat16", seed=0, quantization="int8")
    assert calls == [0]  # nothing left for the after-load pass
    layer = llm.llm_engine.model_runner.model.language_model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    key = next(k for k in state if k.endswith("layers.0.mlp.down_proj.weight"))
    assert state[key].dtype == torch.float32
    expected = quantize_int8(state[key])
    assert torch.equal(layer.mlp.down_proj.qweight.qweight, expected.qweight)
    assert torch.equal(layer.mlp.down_proj.qweight.scales, expected.scales)
    from mmkit.layers import linear_panels, quant_panels
    if quant_panels.available():  # a bf16 engine holds the integers in the quantized panels only
        assert layer.mlp.down_proj.panels is not None
        # the row-major integers stay only where oneDNN's AMX tiles take the larger batches
        assert (layer.mlp.down_proj._qweight is None) == (linear_panels.BF16_MAX_ROWS is None)
        out = llm.generate(["a photo of"], SamplingParams(max_tokens=4, temperature=0))[0]
        assert len(out.outputs[0].token_ids) == 4


def test_online_formulas():
    w = torch.randn(8, 64)
    w[3] = 0
    q8 = quantize_int8(w)
    s = w.abs().amax(1, keepdim=True) / 127
    s[3] = 1
    assert torch.equal(q8.dequantize(), torch.clamp(torch.round(w / s), -127, 127) * s)
    q4 = quantize_int4(w, 32)
    g = w.unflatten(1, (2, 32))
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    s4 = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 15)
    z = torch.round(-lo / s4)
    q = torch.clamp(torch.round(g / s4[..., None]) + z[..., None], 0, 15)
    assert torch.equal(q4.dequantize(), ((q - z[..., None]) * s4[..., None]).flatten(1))


def _write_config(src, dst, quantization_config: dict):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes(b"\xff" * 64)  # any read of the weights would fail differently


def _ct(weights: dict, fmt: str = "pack-quantized", **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **extra}}}


_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
ERRORS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "'awq'"),
    "fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8'"),
    "gptq_actorder": (_ct({**_INT4, "actorder": "group"}), "act-order"),
    "nvfp4": (_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                  "nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    "fp8_block": (_ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                      "float-quantized"), "block"),
    "unknown": ({"quant_method": "mystery"}, "'mystery'"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_unsupported_is_a_clear_error_before_weights(bases, tmp_path, case):
    qconfig, needle = ERRORS[case]
    path = tmp_path / case
    _write_config(bases["llava"], path, qconfig)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32")
    msg = str(info.value)
    assert needle in msg and "pack-quantized, int-quantized, float-quantized" in msg, msg


def test_bad_online_arguments(bases):
    with pytest.raises(ValueError, match="quantization: got 'int3'"):
        LLM(str(bases["llava"]), quantization="int3")
    with pytest.raises(ValueError, match="group_size"):
        LLM(str(bases["llava"]), quantization="int4", quantization_config={"group_size": 0})


def test_fp8_activation_rounding_is_compressed_tensors():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from mmkit.layers.quantized_linear import fp8_per_token_round_trip

    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    # [batch, tokens, hidden] as transformers' layers see it: one scale per token
    x = (torch.randn(5, 64) * torch.logspace(-3, 2, 5)[:, None]).unsqueeze(0)
    scale, zp = compute_dynamic_scales_and_zp(x, args, torch.nn.Linear(64, 8))
    assert torch.equal(fp8_per_token_round_trip(x[0]), fake_quantize(x, scale, zp, args)[0])
