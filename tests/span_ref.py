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


def check_prefix_cache_hit(path, prompt, image, greedy) -> None:
    """A second question about the same image reuses the first one's KV blocks (a hit that
    ends inside the prompt) and its embedding; both answers are transformers'."""
    from mmkit import LLM

    llm = LLM(str(path), dtype="float32", block_size=4)
    q2 = prompt.replace("What is in the image?", "Describe it in one word.")
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, greedy, use_tqdm=False)
    before = llm.get_metrics()
    second = llm.generate({"prompt": q2, "multi_modal_data": {"image": image}}, greedy, use_tqdm=False)
    after = llm.get_metrics()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]
    assert first[0].outputs[0].token_ids == hf_span_greedy(path, prompt, [image])
    assert second[0].outputs[0].token_ids == hf_span_greedy(path, q2, [image])
