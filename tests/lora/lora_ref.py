"""PEFT's PeftModel (the adapter applied, not merged) on transformers: the LoRA reference."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def peft_model(base: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:  # a fresh base each time: PEFT injects its layers into the model it wraps
        model = PeftModel.from_pretrained(model, adapter).eval()
    return model, AutoProcessor.from_pretrained(base)


def peft_greedy(base, adapter, prompt: str, images=None, max_new_tokens: int = 12) -> list[int]:
    """Greedy ids of exactly `max_new_tokens` tokens under `adapter` (None: the base model)."""
    model, processor = peft_model(str(base), None if adapter is None else str(adapter))
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
