"""User-facing prompt forms and the parser that normalizes them.

Every input of one `generate` call is parsed (and cheaply validated) before any request
is added, so a bad input at index 7 leaves nothing behind from indices 0..6.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TypedDict, Union

import torch
from PIL import Image

from typing_extensions import NotRequired

from mmkit.multimodal.items import ImageItem, check_image_size

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class MultiModalData:
    """Images (or ready image embeddings) that belong to one prompt.

    `Type.IMAGE`: a PIL image, a list of PIL images, or a torch tensor of raw pixels in NCHW
    (or CHW for one image): uint8 in 0-255, or float16/bfloat16/float32/float64 in 0-1
    (converted with `round(x * 255)`). `Type.IMAGE_EMBEDS`: a tensor
    `[N, image_seq_length, hidden_size]` that skips the vision tower and projector, or a dict
    `{"image_embeds": tensor, ...}` with the other fields the model's processor reads (e.g.
    `image_grid_thw`; the family's processor documents its layout).
    """

    class Type(enum.Enum):
        IMAGE = "image"
        IMAGE_EMBEDS = "image_embeds"

    def __init__(self, type: "MultiModalData.Type", data: Any) -> None:  # noqa: A002 - vLLM's name
        if not isinstance(type, MultiModalData.Type):
            raise TypeError(
                f"MultiModalData.type: got {type!r}; expected MultiModalData.Type.IMAGE or "
                "MultiModalData.Type.IMAGE_EMBEDS"
            )
        self.type = type
        self.data = data

    def __repr__(self) -> str:
        return f"MultiModalData(type={self.type}, data={type(self.data).__name__})"


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Union[MultiModalData, dict]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Union[MultiModalData, dict]]


PromptInputs = Union[str, TextPrompt, TokensPrompt]

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs")
_MM_DICT_KEYS = {"image": MultiModalData.Type.IMAGE, "image_embeds": MultiModalData.Type.IMAGE_EMBEDS}


@dataclass
class ParsedPrompt:
    """One input in normalized form (before tokenization)."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    images: list[ImageItem] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None  # [N, image_seq_length, hidden]
    # The other tensors of a dict-form embedding input (e.g. an `image_grid_thw`),
    # checked by the family's processor; a family that reads none refuses them.
    image_embeds_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # The raw `multi_modal_data["video"]` value: parsed by processors of video models
    # (mmkit/multimodal/video.py), refused by the others.
    video_data: Any = None
    mm_processor_kwargs: dict | None = None  # per-request processor options (checked by the processor)

    @property
    def num_images(self) -> int:
        if self.image_embeds is not None:
            return int(self.image_embeds.shape[0])
        return len(self.images)


def parse_inputs(inputs: Any, image_map: Callable[..., Iterable[Any]] = map) -> list[ParsedPrompt]:
    """Turn a single input or a list of inputs into `ParsedPrompt`s (validates all).

    Lazily opened image files (`Image.open`) are decoded here, so a truncated file fails
    before any request is added; `image_map` (a `map`, e.g. a thread pool's) decodes them
    side by side. Errors come in input order, as if each input were parsed in turn."""
    if isinstance(inputs, (str, dict)):
        items: Sequence[Any] = [inputs]
    elif isinstance(inputs, (list, tuple)):
        items = inputs
    else:
        raise TypeError(
            f"inputs: got {type(inputs).__name__}; expected a prompt string, a prompt dict "
            "({'prompt': ...} or {'prompt_token_ids': [...]}) or a list of them"
        )
    if len(items) == 0:
        raise ValueError("inputs: got an empty list; expected at least one prompt")
    parsed: list[ParsedPrompt] = []
    try:
        for i, item in enumerate(items):
            parsed.append(parse_prompt(i, item, decode=False))
    except (ValueError, TypeError):
        decode_images(parsed)  # a bad file in an earlier input is the first error
        raise
    decode_images(parsed, image_map)
    return parsed


def decode_images(parsed: Sequence[ParsedPrompt], image_map: Callable[..., Iterable[Any]] = map) -> None:
    """Decode the not yet loaded image files of these inputs; the first failure in input
    order is raised (a ValueError naming the input)."""
    pending = [it for p in parsed for it in p.images
               if isinstance(it.source, Image.Image) and getattr(it.source, "tile", None)]
    for _ in image_map(ImageItem.to_pil, pending):
        pass


def parse_prompt(index: int, item: Any, decode: bool = True) -> ParsedPrompt:
    """One input; `decode=False` leaves lazily opened files undecoded (see `parse_inputs`)."""
    parsed = _parse_prompt(index, item)
    if decode:
        decode_images([parsed])
    return parsed


def _parse_prompt(index: int, item: Any) -> ParsedPrompt:
    where = f"inputs[{index}]"
    if isinstance(item, str):
        _check_text(where, item)
        return ParsedPrompt(index=index, prompt=item, prompt_token_ids=None)
    if not isinstance(item, dict):
        raise TypeError(
            f"{where}: got {type(item).__name__} ({_short(item)}); expected a prompt string or a dict "
            "with 'prompt' or 'prompt_token_ids'"
        )
    unknown = [k for k in item if k not in _PROMPT_KEYS]
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown}; expected only {list(_PROMPT_KEYS)}"
        )
    has_text, has_ids = "prompt" in item, "prompt_token_ids" in item
    if has_text == has_ids:
        got = "both" if has_text else "neither"
        raise ValueError(
            f"{where}: got {got} of 'prompt' and 'prompt_token_ids'; expected exactly one"
        )
    parsed = ParsedPrompt(index=index, prompt=None, prompt_token_ids=None)
    if has_text:
        if not isinstance(item["prompt"], str):
            raise TypeError(
                f"{where}.prompt: got {type(item['prompt']).__name__}; expected str"
            )
        _check_text(f"{where}.prompt", item["prompt"])
        parsed.prompt = item["prompt"]
    else:
        parsed.prompt_token_ids = _parse_token_ids(f"{where}.prompt_token_ids", item["prompt_token_ids"])
    mm = item.get("multi_modal_data")
    if isinstance(mm, dict) and "video" in mm:
        mm = dict(mm)
        parsed.video_data = mm.pop("video")
        mm = mm or None
    if mm is not None:
        _attach_multi_modal(f"{where}.multi_modal_data", parsed, mm)
    if item.get("mm_processor_kwargs") is not None:
        kwargs = item["mm_processor_kwargs"]
        if not isinstance(kwargs, dict):
            raise TypeError(f"{where}.mm_processor_kwargs: got {type(kwargs).__name__}; expected a dict like "
                            "{'max_pixels': 200704}")
        parsed.mm_processor_kwargs = dict(kwargs)
    return parsed


def _check_text(where: str, text: str) -> None:
    if text == "":
        raise ValueError(f"{where}: got an empty prompt; expected non-empty text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would fail obscurely
        raise ValueError(
            f"{where}: got text with an unpaired surrogate {text[exc.start]!r} at position {exc.start}; "
            "expected valid Unicode text"
        ) from None


def _parse_token_ids(where: str, ids: Any) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise TypeError(f"{where}: got a tensor of shape {tuple(ids.shape)} and dtype {ids.dtype}; "
                            "expected a flat list of ints")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{where}: got {type(ids).__name__}; expected a list of ints")
    if len(ids) == 0:
        raise ValueError(f"{where}: got an empty list; expected at least one token id")
    for pos, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise TypeError(f"{where}[{pos}]: got {tok!r} ({type(tok).__name__}); expected an int token id")
        if tok < 0:
            raise ValueError(f"{where}[{pos}]: got {tok}; expected a non-negative token id")
    return list(ids)


def multi_modal_from_dict(where: str, mm: dict) -> MultiModalData:
    """The `{"image": ...}` / `{"image_embeds": ...}` shorthand as a MultiModalData."""
    unknown = [k for k in mm if k not in _MM_DICT_KEYS]
    if unknown or len(mm) != 1:
        raise ValueError(f"{where}: got keys {list(mm)}; expected exactly one of {list(_MM_DICT_KEYS)} "
                         "(plus 'video' for models that take video)")
    key, data = next(iter(mm.items()))
    if key == "image" and isinstance(data, dict) and "image_embeds" in data:
        key = "image_embeds"  # vLLM's form: {"image": {"image_embeds": ..., "image_grid_thw": ...}}
    return MultiModalData(type=_MM_DICT_KEYS[key], data=data)


def _attach_multi_modal(where: str, parsed: ParsedPrompt, mm: Any) -> None:
    if isinstance(mm, dict):
        mm = multi_modal_from_dict(where, mm)
    if not isinstance(mm, MultiModalData):
        raise TypeError(
            f"{where}: got {type(mm).__name__}; expected MultiModalData or a dict like {{'image': img}}"
        )
    if mm.type is MultiModalData.Type.IMAGE:
        parsed.images = parse_images(where, mm.data)
    elif isinstance(mm.data, dict):
        parsed.image_embeds, parsed.image_embeds_fields = _parse_embeds_dict(where, mm.data)
    else:
        parsed.image_embeds = _parse_embeds(where, mm.data)


def parse_images(where: str, data: Any) -> list[ImageItem]:
    """Validate raw images: PIL image(s) or an NCHW/CHW pixel tensor."""
    if isinstance(data, Image.Image):
        return [_pil_item(where, data)]
    if isinstance(data, (list, tuple)):
        items = []
        for i, img in enumerate(data):
            if isinstance(img, torch.Tensor):
                items.extend(_tensor_items(f"{where}[{i}]", img, allow_batch=False))
            elif isinstance(img, Image.Image):
                items.append(_pil_item(f"{where}[{i}]", img))
            else:
                raise TypeError(
                    f"{where}[{i}]: got {type(img).__name__}; expected a PIL image or a CHW tensor"
                )
        return items
    if isinstance(data, torch.Tensor):
        return _tensor_items(where, data, allow_batch=True)
    raise TypeError(
        f"{where}: got {type(data).__name__}; expected a PIL image, a list of PIL images, "
        "or a uint8/float torch tensor in NCHW or CHW layout"
    )


def _pil_item(where: str, img: Image.Image) -> ImageItem:
    width, height = img.size
    check_image_size(where, width, height)
    # NOTE: a lazily opened file is decoded by `parse_prompt`/`parse_inputs` (a truncated
    # file must fail before any request of the call is added, not in a later step).
    return ImageItem(source=img, width=width, height=height, where=where)


def _tensor_items(where: str, data: torch.Tensor, allow_batch: bool) -> list[ImageItem]:
    if data.dim() == 3:
        data = data.unsqueeze(0)
    elif data.dim() != 4 or not allow_batch:
        expected = "NCHW or CHW" if allow_batch else "CHW"
        raise ValueError(f"{where}: got a tensor of shape {tuple(data.shape)}; expected {expected}")
    if data.shape[0] == 0:
        raise ValueError(f"{where}: got a tensor of shape {tuple(data.shape)} (no image); expected N >= 1 "
                         "images in NCHW layout")
    if data.is_complex() or data.dtype == torch.bool:
        raise TypeError(
            f"{where}: got a tensor of dtype {data.dtype}; expected uint8 (0-255) or "
            "float16/bfloat16/float32/float64 (0-1)"
        )
    if data.shape[1] not in (1, 3):
        raise ValueError(
            f"{where}: got {data.shape[1]} channels in shape {tuple(data.shape)}; expected 1 or 3 "
            "(NCHW or CHW layout)"
        )
    height, width = int(data.shape[2]), int(data.shape[3])
    check_image_size(where, width, height)
    if data.dtype in _FLOAT_DTYPES:
        if not bool(torch.isfinite(data).all()):
            raise ValueError(f"{where}: got NaN or Inf pixel values; expected finite floats in [0, 1]")
        lo, hi = float(data.min()), float(data.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(
                f"{where}: got float pixel values in [{lo:g}, {hi:g}]; expected raw pixels in [0, 1] "
                "(not normalized pixel_values)"
            )
    elif data.dtype != torch.uint8:
        raise TypeError(
            f"{where}: got a tensor of dtype {data.dtype}; expected uint8 (0-255) or "
            "float16/bfloat16/float32/float64 (0-1)"
        )
    if data.shape[0] == 1:
        return [ImageItem(source=data[0].detach(), width=width, height=height, where=where)]
    return [ImageItem(source=img, width=width, height=height, where=f"{where}[{i}]")
            for i, img in enumerate(data.detach())]


def _parse_embeds(where: str, data: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{where}: got {type(data).__name__}; expected a tensor [N, image_seq_length, hidden_size]")
    if data.dim() == 2:
        data = data.unsqueeze(0)
    if data.dim() != 3:
        raise ValueError(
            f"{where}: got image embeddings of shape {tuple(data.shape)}; expected "
            "[N, image_seq_length, hidden_size]"
        )
    if not data.dtype.is_floating_point:
        raise TypeError(f"{where}: got image embeddings of dtype {data.dtype}; expected a float tensor")
    if not bool(torch.isfinite(data).all()):
        raise ValueError(f"{where}: got NaN or Inf in image embeddings; expected finite values")
    return data.detach()


def _parse_embeds_dict(where: str, data: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`{"image_embeds": tensor, <field>: tensor, ...}`: the embeddings and the other fields
    (which ones a family needs, and their shapes, its processor checks)."""
    if "image_embeds" not in data:
        raise ValueError(f"{where}: got an embeddings dict with keys {list(data)}; expected an 'image_embeds' "
                         "tensor (plus the fields the model's processor reads, e.g. 'image_grid_thw')")
    fields = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: got a key {key!r} ({type(key).__name__}); expected str keys")
        if key != "image_embeds":
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}['{key}']: got {type(value).__name__}; expected a torch tensor")
            fields[key] = value.detach()
    embeds = _parse_embeds(f"{where}['image_embeds']", data["image_embeds"])
    if data["image_embeds"].dim() == 2:  # [tokens, width] as given: the fields say how it splits
        embeds = embeds[0]
    return embeds, fields


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
