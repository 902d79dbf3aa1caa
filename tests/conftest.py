"""Shared fixtures: tiny random LLaVA checkpoints built offline, and HF reference runs."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoids 20-100x spin slowdowns
# The bounds-checking build of the C kernels: a bad block id or slot raises IndexError
# instead of reading or writing outside the KV cache (mmkit/layers/cpu_kernels.py).
os.environ.setdefault("MMKIT_KERNEL_CHECKS", "1")

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(int(os.environ.get("MMKIT_TEST_THREADS", "2")))
sys.path.insert(0, str(Path(__file__).parent))

from mmkit.testing import build_tiny_llava, rewrite_hub_layout  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


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


def bf16_agreement(path, device, inputs, refs, max_tokens: int = 16) -> float:
    """Greedy bf16 runs of mmkit and of transformers' own bf16 generate on the same inputs:
    the share of reference tokens generated before the first divergence (1.0 = all equal).
    bf16 near-ties can flip under different (equally valid) rounding, hence a rate."""
    from mmkit import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device=device)
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    ref = [hf_greedy(path, max_new_tokens=max_tokens, dtype=torch.bfloat16, ignore_eos=True, **r) for r in refs]
    agreed = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
                 for g, r in zip(got, ref))
    return agreed / sum(len(r) for r in ref)


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
