"""Shared fixtures: tiny random LLaVA checkpoints built offline, and HF reference runs."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoids 20-100x spin slowdowns
# The bounds-checking build of the C kernels: a bad block id or slot raises IndexError
# instead of reading or writing outside the KV cache (mmkit/layers/cpu_kernels.py).
os.environ.setdefault("MMKIT_KERNEL_CHECKS", "1")

import math
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(int(os.environ.get("MMKIT_TEST_THREADS", "2")))
# float32 parity on CUDA is exact only without TF32 matmuls (transformers' CPU reference has none).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
sys.path.insert(0, str(Path(__file__).parent))

from mmkit.testing import build_tiny_llava, rewrite_hub_layout  # noqa: E402

# Every CUDA-only test carries the `cuda` marker (`pytest -m cuda` selects them on a GPU machine;
# pytest_collection_modifyitems below skips them with a reason where there is none).
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Multi-head attention, untied embeddings."""
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_mha"), seed=0)


@pytest.fixture(scope="session")
def gqa_tied_ckpt(tmp_path_factory) -> Path:
    """Grouped-query attention (4 heads, 2 KV heads) with tied embeddings."""
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_gqa"), seed=1, num_kv_heads=2,
                            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hub_ckpt(gqa_tied_ckpt, tmp_path_factory) -> Path:
    """The GQA checkpoint rewritten in the hub's layout (old keys, rope_theta, fp16, 2 shards)."""
    return rewrite_hub_layout(gqa_tied_ckpt, tmp_path_factory.mktemp("tiny_hub"))


def make_image(seed: int, width: int = 40, height: int = 30) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def resave_checkpoint(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint folder `src` at `dst` with its state dict passed through `edit`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def break_pixels_of_width(monkeypatch, processor, width: int) -> None:
    """Make `processor.pixel_values` raise OSError for any image `width` pixels wide (an image
    that decodes but fails in the image processor, when its request is scheduled)."""
    original = processor.pixel_values

    def fragile(images):
        if any(item.width == width for item in images):
            raise OSError("broken image data")
        return original(images)

    monkeypatch.setattr(processor, "pixel_values", fragile)


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """[3, H, W] uint8."""
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


@lru_cache(maxsize=8)
def _hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    # The checkpoint's own class (LLaVA, LLaVA-NeXT, LLaVA-OneVision).
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(path)


def hf_greedy(path, prompt=None, images=None, input_ids=None, max_new_tokens=16, dtype=torch.float32,
              ignore_eos=False) -> list[int]:
    """transformers' own greedy generate: the reference for every parity test. `ignore_eos`
    forces exactly max_new_tokens (HF's min_new_tokens), as mmkit's ignore_eos does."""
    model, processor = _hf_model(str(path), dtype)
    if prompt is not None:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
    else:
        inputs = {"input_ids": torch.tensor([input_ids]), "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
        if images is not None:  # pixel_values (and image_sizes for anyres families)
            inputs.update(processor.image_processor(images=images, return_tensors="pt"))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens if ignore_eos else None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@lru_cache(maxsize=16)
def _cached_llm(path: str, device: str, extra: tuple):
    from mmkit import LLM

    return LLM(path, dtype="float32", device=device, **dict(extra))


def get_llm(path, device="cpu", **kwargs):
    """One LLM per (checkpoint, device, kwargs) for the whole session."""
    return _cached_llm(str(path), device, tuple(sorted(kwargs.items())))


def _bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significand bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def assert_bf16_matches_hf(path, device, inputs, refs, max_tokens: int = 16, max_ulps: int = 4) -> int:
    """Greedy bf16 runs of mmkit and of transformers' own bf16 generate on the same inputs
    (`refs[i]`: hf_greedy keyword arguments with `prompt`, optional `images`). Every sequence
    must equal transformers', or first differ where transformers' own bf16 logits (a forward over
    the prompt and the tokens both agreed on) put the two tokens within `max_ulps` bf16 ulps of
    each other: a tie that another (equally valid) rounding order flips, not a bug. Returns the
    number of equal sequences. Nothing here depends on how fast or how loaded the machine is."""
    from mmkit import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device=device)
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    model, processor = _hf_model(str(path), torch.bfloat16)
    num_equal = 0
    for i, (out, ref) in enumerate(zip(outs, refs)):
        got = list(out.outputs[0].token_ids)
        expected = hf_greedy(path, max_new_tokens=max_tokens, dtype=torch.bfloat16, ignore_eos=True, **ref)
        if got == expected:
            num_equal += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
        hf_inputs = dict(processor(text=ref["prompt"], images=ref.get("images"), return_tensors="pt"))
        prefix = torch.tensor([expected[:k]], dtype=torch.long)
        length = hf_inputs["input_ids"].shape[1]
        for key, value in list(hf_inputs.items()):  # every per-token row grows with the prefix
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                fill = prefix if key == "input_ids" else (torch.ones_like(prefix) if key == "attention_mask"
                                                          else torch.zeros_like(prefix))
                hf_inputs[key] = torch.cat([value, fill.to(value.dtype)], 1)
        with torch.no_grad():
            logits = model(**hf_inputs).logits[0, -1].float()
        gap = abs(float(logits[expected[k]] - logits[got[k]]))
        assert gap <= max_ulps * _bf16_ulp(float(logits[expected[k]])), \
            f"inputs[{i}]: token {k} is {got[k]}, transformers' {expected[k]}; logit gap {gap:g} is no bf16 tie"
    return num_equal


_HF_REFS: dict = {}


def assert_generate_matches_hf(llm, path, inputs, refs, max_tokens, cache_key=None):
    """`llm.generate(inputs)` (greedy, exactly `max_tokens` each) gives transformers' ids for
    each `refs[i]` (hf_greedy keyword arguments); HF runs are reused under `cache_key`."""
    from mmkit import SamplingParams

    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    expected = _HF_REFS.get(cache_key) if cache_key is not None else None
    if expected is None:
        expected = [hf_greedy(path, max_new_tokens=max_tokens, ignore_eos=True, **r) for r in refs]
        if cache_key is not None:
            _HF_REFS[cache_key] = expected
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"inputs[{i}]"
    return outs


def blocks_held_while_decoding(llm) -> tuple[int, int]:
    """Step `llm`'s engine until its requests end: (the most KV blocks held at once after the
    first step, the number of steps). The first step is the prompt's, which holds all of its
    blocks; a sliding-window model then holds only the blocks its window reads."""
    engine = llm.llm_engine
    held_max, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        metrics = llm.get_metrics()
        if steps > 1:
            held_max = max(held_max, metrics["kv_blocks_total"] - metrics["kv_blocks_free"])
    return held_max, steps
