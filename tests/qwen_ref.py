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


def assert_chat_and_serve_equal_transformers(ckpt, image, max_tokens: int = 12) -> None:
    """`LLM.chat` on one image renders the checkpoint's chat template as transformers' processor
    does and gives transformers' greedy ids (float32); an OpenAI chat completion from `mmkit
    serve` with the same messages gives the same text."""
    import openai

    from mmkit import LLM, SamplingParams
    from serve_utils import ServerProcess, data_uri, image_message

    messages = image_message(data_uri(image), "Describe it.")
    out = LLM(str(ckpt), dtype="float32").chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens),
                                               use_tqdm=False)[0]
    model, processor = hf_qwen(str(ckpt))
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == prompt
    inputs = hf_inputs(ckpt, prompt, [image])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    assert list(out.outputs[0].token_ids) == ref[0, inputs["input_ids"].shape[1]:].tolist()
    server = ServerProcess("--model", str(ckpt), "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens)
        assert reply.choices[0].message.content == out.outputs[0].text
    finally:
        assert server.stop() == 0, server.output()[-3000:]
