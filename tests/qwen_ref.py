"""transformers' own Qwen2-VL / Qwen2.5-VL runs: the reference for the Qwen tests."""

from __future__ import annotations

from functools import lru_cache

import torch

P_IMG = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the image?<|im_end|>\n"
         "<|im_start|>assistant\n")
P_2IMG = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|> and "
          "<|vision_start|><|image_pad|><|vision_end|>Describe both.<|im_end|>\n<|im_start|>assistant\n")
P_VID = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe this video.<|im_end|>\n"
         "<|im_start|>assistant\n")
P_IMG_VID = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|> then "
             "<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n<|im_start|>assistant\n")


@lru_cache(maxsize=4)
def hf_qwen(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(path)


def hf_inputs(path, prompt, images=None, videos=None, mm_kwargs=None):
    _, processor = hf_qwen(str(path))
    kwargs = {}
    mm_kwargs = dict(mm_kwargs or {})
    if "fps" in mm_kwargs and "Qwen3VL" in type(processor).__name__:  # Qwen3-VL: the sampling rate
        kwargs["fps"] = mm_kwargs.pop("fps")
    if mm_kwargs:
        size = dict(processor.image_processor.size)
        size["shortest_edge"] = mm_kwargs.get("min_pixels", size["shortest_edge"])
        size["longest_edge"] = mm_kwargs.get("max_pixels", size["longest_edge"])
        kwargs["size"] = size
    return processor(text=[prompt], images=images, videos=[videos] if videos is not None else None,
                     return_tensors="pt", **kwargs)


def hf_qwen_greedy(path, prompt, images=None, videos=None, max_new_tokens=32, mm_kwargs=None,
                   dtype=torch.float32) -> list[int]:
    """Greedy ids of exactly `max_new_tokens` tokens (mmkit runs with ignore_eos)."""
    model, _ = hf_qwen(str(path), dtype)
    inputs = hf_inputs(path, prompt, images, videos, mm_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
