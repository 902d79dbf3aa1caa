"""compressed-tensors W4A16 with 16-weight groups: the multimodal projector quantized too
(greedy ids, text and image, equal to transformers loading the same checkpoint dequantized),
and the int4 decoder weights held packed (two per byte) at every group size the layout allows."""

from __future__ import annotations

import pytest
import torch

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.layers.quant_pack import from_int_values
from mmkit.layers.quantized_linear import QuantizedLinear, dequantize, quant_gemm
from mmkit.testing import build_tiny_checkpoint
from mmkit.testing.compressed import quantize_checkpoint

NUM_TOKENS = 10
ARCHS = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
# the vision tower stays float; the projector (LLaVA's multi_modal_projector, Qwen2-VL's merger) is quantized
IGNORE_TOWER_ONLY = {"llava": ("lm_head", "re:.*vision_tower.*"),
                     "qwen2_vl": ("lm_head", "re:.*visual\\.blocks.*", "re:.*visual\\.patch_embed.*")}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    pytest.importorskip("compressed_tensors")  # the `quant` extra: it writes and reads these checkpoints
    root = tmp_path_factory.mktemp("quant16")
    return {name: build_tiny_checkpoint(arch, root / name) for name, arch in ARCHS.items()}


def _messages(with_image: bool) -> list[dict]:
    content = [{"type": "text", "text": "What is in the image?"}]
    if with_image:
        content.insert(0, {"type": "image", "image": make_image(5, 48, 40)})
    return [{"role": "user", "content": content}]


def _hf_ids(path, messages) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of transformers loading the compressed checkpoint dequantized."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, CompressedTensorsConfig

    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    model.generation_config.eos_token_id = None  # as mmkit's ignore_eos: EOS is an ordinary token
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


@pytest.mark.parametrize("family", list(ARCHS))
def test_projector_quantized_with_group_16(bases, tmp_path, family):
    path = quantize_checkpoint(bases[family], tmp_path / "w4g16", "W4A16", group_size=16,
                               ignore=IGNORE_TOWER_ONLY[family], keep_regex_ignore=True)
    llm = LLM(str(path), dtype="float32", seed=0)
    model = llm.llm_engine.model_runner.model
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    projector = "multi_modal_projector" if family == "llava" else "visual.merger"
    assert any(n.startswith(projector) for n in quantized), quantized
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for with_image in (False, True):
        messages = _messages(with_image)
        out = llm.chat(messages, params, use_tqdm=False)[0]
        prompt_ids, ref = _hf_ids(path, messages)
        assert list(out.prompt_token_ids) == prompt_ids
        assert list(out.outputs[0].token_ids) == ref, with_image


def test_int4_group_16_is_held_packed(bases, tmp_path):
    """0.5 byte per weight + a float32 scale and a uint8 zero per 16: 0.8125 bytes, 0.20x of
    float32 (it was 1 byte per weight, int8, 1.3125 bytes: 0.33x)."""
    path = quantize_checkpoint(bases["llava"], tmp_path / "w4g16", "W4A16", group_size=16)
    metrics = LLM(str(path), dtype="float32").get_metrics()
    base = LLM(str(bases["llava"]), dtype="float32").get_metrics()
    ratio = metrics["decoder_linear_weight_bytes"] / base["decoder_linear_weight_bytes"]
    assert ratio <= 0.21, ratio
    model = LLM(str(path), dtype="float32").llm_engine.model_runner.model
    layers = [m for m in model.language_model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.qweight.bits == 4 and m.qweight.group_size == 16 for m in layers)


@pytest.mark.parametrize("group_size", [16, 48])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int4_kernels_at_group_sizes_below_or_across_32(group_size, rows):
    """Every path a packed int4 weight takes (GEMV, dequantize, the layer's forward in float32
    and bf16) computes w' = (q - z) * s of the same integers."""
    torch.manual_seed(0)
    n, k = 40, 96
    q = torch.randint(0, 16, (n, k), dtype=torch.int16)
    scales = torch.rand(n, k // group_size) + 0.01
    zeros = torch.randint(0, 16, (n, k // group_size), dtype=torch.int16)
    qw = from_int_values(q, scales, zeros, 4, group_size)
    assert qw.bits == 4 and qw.qweight.shape == (n, k // 2)
    ref = ((q.float().unflatten(1, (-1, group_size)) - zeros.float()[..., None]) * scales[..., None]).flatten(1)
    assert torch.equal(qw.dequantize(), ref)
    assert torch.equal(dequantize(qw, torch.float32), ref)
    x = torch.randn(rows, k)
    # float32 sums of k products in another order: the error bound scales with sum |x| |w|
    # (a result near 0 from large terms cancelling differs by more than 1e-5 on some CPUs).
    bound = 1e-6 * (x.abs() @ ref.abs().T) + 1e-6

    def check(out: torch.Tensor) -> None:
        assert ((out - x @ ref.T).abs() <= bound).all(), (out - x @ ref.T).abs().max()

    gemv = quant_gemm(x, qw)
    if gemv is not None:
        check(gemv)
    layer = QuantizedLinear(qw, None)
    check(layer(x))
    from mmkit.layers import quant_panels
    assert layer.pack(torch.bfloat16) == quant_panels.available()  # the quantized panels where this CPU has them
    xb = x.bfloat16()
    want = xb.float() @ ref.T
    torch.testing.assert_close(layer(xb).float(), want, rtol=0, atol=0.02 * want.abs().max().item())
