"""transformers' own runs for the span families (Mistral 3, Idefics3, SmolVLM): the reference."""

from __future__ import annotations

import torch

from conftest import _hf_model


def hf_span_inputs(path, prompt, images=None, videos=None, mm_kwargs=None):
    """The checkpoint's HF processor on one prompt (images / one video / processor options)."""
    _, processor = _hf_model(str(path))
    kwargs = dict(mm_kwargs or {})
    if images:
        kwargs["images"] = [images]
    if videos is not None:
        kwargs["videos"] = [videos]
    return processor(text=[prompt], return_tensors="pt", **kwargs)


def hf_span_greedy(path, prompt, images=None, videos=None, mm_kwargs=None, max_new_tokens=33) -> list[int]:
    """transformers' greedy generate, exactly `max_new_tokens` tokens."""
    model, _ = _hf_model(str(path))
    inputs = hf_span_inputs(path, prompt, images, videos, mm_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
