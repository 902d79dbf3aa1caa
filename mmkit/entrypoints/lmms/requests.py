"""lmms-eval request parts -> mmkit inputs: visuals and generation kwargs."""

from __future__ import annotations

from typing import Any

from PIL import Image

from mmkit.sampling_params import SamplingParams

_VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".wmv")


def split_visuals(visuals: Any) -> tuple[list[Image.Image], list[Any]]:
    """A `doc_to_visual` result -> (images, videos). Nested lists are flattened; a string is a
    video path if it ends like one, else an image path; None entries are dropped."""
    flat: list[Any] = []
    stack = [visuals]
    while stack:
        v = stack.pop(0)
        if isinstance(v, (list, tuple)):
            stack[:0] = list(v)
        elif v is not None:
            flat.append(v)
    images, videos = [], []
    for v in flat:
        if isinstance(v, Image.Image):
            images.append(v.convert("RGB") if v.mode != "RGB" else v)
        elif isinstance(v, str) and v.lower().endswith(_VIDEO_SUFFIXES):
            videos.append(v)
        elif isinstance(v, str):
            images.append(Image.open(v).convert("RGB"))
        else:
            raise TypeError(f"doc_to_visual: got {type(v).__name__}; expected PIL images, image or video paths")
    return images, videos


def sampling_params_from(gen_kwargs: dict | None, default_max_new_tokens: int, where: str) -> SamplingParams:
    """A task's `generation_kwargs` (HF generate names) -> `SamplingParams`. Like lmms-eval's
    vLLM backend, `temperature` is used as given (default 0: greedy); `do_sample: false` forces
    greedy and `do_sample: true` without a temperature samples at 1. Options that shape HF's
    own decoding loop (use_cache, image_aspect_ratio, ...) are ignored."""
    kw = dict(gen_kwargs or {})
    until = kw.pop("until", None)
    stop = [until] if isinstance(until, str) else [s for s in (until or []) if s]
    max_new = kw.pop("max_new_tokens", None) or kw.pop("max_gen_toks", None) or default_max_new_tokens
    do_sample = kw.pop("do_sample", None)
    temperature = float(kw.pop("temperature", 0.0) or 0.0)
    if do_sample is False:
        temperature = 0.0
    elif do_sample and temperature == 0.0:
        temperature = 1.0  # HF's default when sampling
    num_beams = int(kw.pop("num_beams", 1) or 1)
    if num_beams != 1:
        raise ValueError(f"{where}: generation_kwargs.num_beams: got {num_beams}; mmkit has no beam search (expected 1)")
    params: dict[str, Any] = {"temperature": temperature, "max_tokens": int(max_new), "stop": stop or None}
    if temperature > 0:
        for key in ("top_p", "top_k", "min_p"):
            if kw.get(key) is not None:
                params[key] = kw.pop(key)
        if kw.get("seed") is not None:
            params["seed"] = int(kw.pop("seed"))
    if kw.get("repetition_penalty") is not None:
        params["repetition_penalty"] = float(kw.pop("repetition_penalty"))
    return SamplingParams(**params)
