"""transformers' own greedy runs of the tiny hf_tiny checkpoints: the reference the transformers
backend is compared with. EOS is ignored (an empty `eos_token_id`), so every run gives exactly
`max_tokens` ids, as mmkit does with `ignore_eos=True`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from mmkit.testing.hf_tiny import SPECS


@lru_cache(maxsize=8)
def hf_model(path: str):
    """(model, processor) loaded with transformers' Auto classes, float32, eval."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def request_inputs(path: str, request: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model inputs of one request: {"prompt": str, "images": [PIL] | None} through the
    checkpoint's processor, or {"prompt_token_ids": [...]} as they are. Floating tensors in
    float32 (Llama 4's image processor writes bfloat16 pixels)."""
    _, processor = hf_model(str(path))
    if "prompt_token_ids" in request:
        ids = torch.tensor([request["prompt_token_ids"]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = processor(text=request["prompt"], images=request.get("images") or None, return_tensors="pt")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()
            if isinstance(v, torch.Tensor) and k != "labels"}


def hf_greedy(path, request: dict[str, Any], max_tokens: int) -> list[int]:
    """`generate`'s greedy ids (KV cache, EOS ignored)."""
    model, _ = hf_model(str(path))
    inputs = request_inputs(str(path), request)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[],
                             pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_greedy_no_cache(path, request: dict[str, Any], max_tokens: int) -> list[int]:
    """The same greedy ids with the whole sequence recomputed by `forward` at every step (no
    cache): what `hf_greedy` must equal for the reference to be trusted. Per-token inputs that
    the processor writes (token_type_ids, mm_token_type_ids) grow by the generated tokens' value
    (text: 1 for PaliGemma's suffix, 0 otherwise). A generated special token (an image or
    marker id) would be read as a placeholder by `forward`, so the run stops after one: the
    ids up to it are well defined."""
    model, processor = hf_model(str(path))
    special_ids = set(processor.tokenizer.get_added_vocab().values())
    inputs = request_inputs(str(path), request)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    generated = []
    with torch.no_grad():
        for _ in range(max_tokens):
            step = dict(inputs)
            for key, suffix_value in (("token_type_ids", 1), ("mm_token_type_ids", 0)):
                if key in step:
                    grow = ids.shape[1] - step[key].shape[1]
                    step[key] = torch.cat([step[key], step[key].new_full((1, grow), suffix_value)], dim=1)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **step).logits
            next_id = int(logits[0, -1].argmax())
            generated.append(next_id)
            if next_id in special_ids:
                break
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return generated


def placeholder(name: str) -> str:
    return SPECS[name].placeholder
