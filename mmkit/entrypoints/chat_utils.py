"""OpenAI-style chat messages -> prompts rendered with the checkpoint's chat template.

A message's content is a string or a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}` (a `data:image/...;base64,` URI, a local
path, a `file://` URL or http(s)) and `{"type": "image", "image": PIL.Image}`; for video models also
`{"type": "video_url", "video_url": {"url": "clip.mp4" | [frame, ...]}}` and `{"type": "video",
"video": frames}`. Images and videos are collected in order of appearance; the template places
one placeholder per part.

Image embeddings (vLLM's part): `{"type": "image_embeds", "image_embeds": <base64 of torch.save(tensor)>}`,
or a dict of such strings with the fields the model reads beside them (`{"image_embeds": ...,
"image_grid_thw": ...}`, `{"image_embeds": ..., "image_sizes": ...}`: docs/models.md, per family);
`LLM.chat` takes tensors as well as strings. Each part is an image
for the template; a conversation's parts are joined into one `multi_modal_data["image"]` input
(shapes in docs/models.md) and may not be mixed with image parts.

Tool calling: an assistant message may carry `tool_calls` (its `content` then may be None or
absent), and a `role: "tool"` message (with its `tool_call_id`) holds the tool's result, a string
or parts, images included. They reach the template as transformers' `apply_chat_template` gets
them: None-valued keys dropped, a tool result's string content left a string.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Sequence

import torch

from PIL import Image

from mmkit.multimodal.image_io import load_image
from mmkit.multimodal.media_fetch import MediaConnector

Conversation = list[dict[str, Any]]
_ROLES = ("system", "user", "assistant", "tool")


def is_conversation_list(messages: Any) -> bool:
    """A list of conversations (lists of messages), as opposed to one conversation."""
    return isinstance(messages, (list, tuple)) and len(messages) > 0 and all(
        isinstance(m, (list, tuple)) for m in messages)


def parse_conversation(index: int, messages: Any, videos: list | None = None,
                       media: MediaConnector | None = None) -> tuple[Conversation, list[Any]]:
    """Validate one conversation; return it in the HF template's form and its images (PIL
    images, or the decoded `image_embeds` parts: tensors or dicts of tensors). Video parts are
    accepted only when `videos` is a list (a video model); they are appended to it."""
    where = f"messages[{index}]"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: got {type(messages).__name__}; expected a non-empty list of messages")
    conversation: Conversation = []
    images: list[Image.Image] = []
    for m, message in enumerate(messages):
        mwhere = f"{where}[{m}]"
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{mwhere}: got {message!r:.80}; expected a dict with 'role' and 'content'")
        role = message["role"]
        if role not in _ROLES:
            raise ValueError(f"{mwhere}.role: got {role!r}; expected one of {list(_ROLES)}")
        tool_fields = _tool_fields(mwhere, message)
        content = message.get("content")
        if content is None and "tool_calls" in tool_fields:
            # NOTE: no `content` key at all, as transformers drops None values before rendering.
            conversation.append({"role": role, **tool_fields})
            continue
        if "content" not in message:
            raise ValueError(f"{mwhere}: got {message!r:.80}; expected a dict with 'role' and 'content'")
        if isinstance(content, str):
            # A tool result's text stays a string: tool templates print `message.content` as is.
            text = content if role == "tool" else [{"type": "text", "text": content}]
            conversation.append({"role": role, "content": text, **tool_fields})
            continue
        if not isinstance(content, (list, tuple)):
            raise TypeError(f"{mwhere}.content: got {type(content).__name__}; expected a string or a list of parts")
        parts = []
        for p, part in enumerate(content):
            parts.append(_parse_part(f"{mwhere}.content[{p}]", part, images, videos, media))
        conversation.append({"role": role, "content": parts, **tool_fields})
    return conversation, images


def _tool_fields(where: str, message: dict[str, Any]) -> dict[str, Any]:
    """What a template reads of tool calling: an assistant's `tool_calls` (as given: `arguments`
    stays the JSON string the client sent), a tool result's `tool_call_id` and `name`."""
    role = message["role"]
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
            raise TypeError(f"{where}.tool_calls: got {calls!r:.80}; expected a list of tool-call objects")
        return {"tool_calls": [dict(c) for c in calls]}
    if role == "tool":
        return {key: message[key] for key in ("tool_call_id", "name") if message.get(key) is not None}
    return {}


def _parse_part(where: str, part: Any, images: list[Image.Image], videos: list | None,
                media: MediaConnector | None = None) -> dict[str, Any]:
    if not isinstance(part, dict) or "type" not in part:
        raise ValueError(f"{where}: got {part!r:.80}; expected a dict with a 'type'")
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"{where}.text: got {type(text).__name__}; expected str")
        return {"type": "text", "text": text}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise ValueError(f"{where}.image_url: got {spec!r:.80}; expected {{'url': 'data:...|path|file://...|https://...'}}")
        images.append(load_image(url, where=where, media=media))
        return {"type": "image"}
    if kind == "image":
        img = part.get("image")
        if not isinstance(img, Image.Image):
            raise TypeError(f"{where}.image: got {type(img).__name__}; expected a PIL image")
        images.append(img)
        return {"type": "image"}
    if kind == "image_embeds":
        images.append(_image_embeds(f"{where}.image_embeds", part.get("image_embeds")))
        return {"type": "image"}
    if kind in ("video_url", "video") and videos is not None:
        from mmkit.multimodal.video_io import load_video

        spec = part.get(kind)
        source = spec.get("url") if kind == "video_url" and isinstance(spec, dict) else spec
        if kind == "video" and not isinstance(source, (str, list, tuple)):
            videos.append(source)  # a (T, C, H, W) tensor, checked by the input parser
        else:
            videos.append(load_video(source, where=f"{where}.{kind}", media=media))
        return {"type": "video"}
    expected = "'text', 'image_url', 'image', 'image_embeds', 'video_url' or 'video'" if videos is not None \
        else "'text', 'image_url', 'image' or 'image_embeds' (this model takes no video)"
    raise ValueError(f"{where}.type: got {kind!r}; expected {expected}")


def _image_embeds(where: str, value: Any) -> torch.Tensor | dict[str, torch.Tensor]:
    """An `image_embeds` part's value: a tensor (base64 of `torch.save`, or a tensor), or a dict of them."""
    if isinstance(value, dict):
        if "image_embeds" not in value:
            raise ValueError(f"{where}: got keys {list(value)}; expected an 'image_embeds' entry (plus the fields "
                             "the model reads, e.g. 'image_grid_thw' or 'image_sizes')")
        return {str(k): _tensor(f"{where}.{k}", v) for k, v in value.items()}
    return _tensor(where, value)


def _tensor(where: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{where}: got {type(value).__name__}; expected a base64 string of torch.save(tensor)")
    try:
        loaded = torch.load(io.BytesIO(base64.b64decode(value, validate=True)), weights_only=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: got a string that is not base64; expected base64 of torch.save(tensor)") from exc
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on foreign bytes
        raise ValueError(f"{where}: could not load a tensor ({exc}); expected base64 of torch.save(tensor)") from exc
    if not isinstance(loaded, torch.Tensor):
        raise TypeError(f"{where}: got a saved {type(loaded).__name__}; expected a saved torch tensor")
    return loaded


def _joined_embeds(where: str, parts: list[Any]) -> Any:
    """A conversation's `image_embeds` parts as one `multi_modal_data["image"]` value: one part as
    given; tensors stacked to [N, tokens, hidden]; dicts as [sum of tokens, width] with their fields
    concatenated image by image."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        rows = [p if p.dim() == 3 else p.unsqueeze(0) for p in parts]
        if len({tuple(r.shape[1:]) for r in rows}) != 1:
            raise ValueError(f"{where}: got image_embeds parts of shapes {[tuple(p.shape) for p in parts]}; expected "
                             "equal [tokens, hidden] shapes (or dict parts with the size fields)")
        return torch.cat(rows)
    if not all(isinstance(p, dict) for p in parts) or len({tuple(sorted(p)) for p in parts}) != 1:
        raise ValueError(f"{where}: got image_embeds parts of different forms; expected all tensors or all dicts "
                         "with the same keys")
    joined = {"image_embeds": torch.cat([p["image_embeds"].reshape(-1, p["image_embeds"].shape[-1]) for p in parts])}
    for key in parts[0]:
        if key != "image_embeds":
            joined[key] = torch.cat([p[key] if p[key].dim() > 1 else p[key].unsqueeze(0) for p in parts])
    return joined


def render(processor, conversation: Conversation, chat_template: str | None, add_generation_prompt: bool) -> str:
    """Apply the chat template (the checkpoint's, or the one given) to one conversation."""
    template = chat_template or getattr(processor, "chat_template", None) \
        or getattr(getattr(processor, "tokenizer", None), "chat_template", None)
    if template is None:
        raise ValueError(
            "chat_template: the checkpoint has no chat template; pass chat_template=... to LLM.chat"
        )
    return processor.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def conversations_to_inputs(processor, messages: Any, chat_template: str | None = None,
                            add_generation_prompt: bool = True, allow_video: bool = False,
                            media: MediaConnector | None = None) -> list[dict[str, Any]]:
    """One conversation or a list of them -> `generate` inputs (prompt + its images). `media`: where
    image and video parts may be read from and the download limits (default: anywhere, env limits)."""
    conversations: Sequence[Any] = messages if is_conversation_list(messages) else [messages]
    inputs = []
    for i, conv in enumerate(conversations):
        videos: list | None = [] if allow_video else None
        parsed, images = parse_conversation(i, conv, videos, media)
        prompt = render(processor, parsed, chat_template, add_generation_prompt)
        bos = getattr(getattr(processor, "tokenizer", processor), "bos_token", None)
        if bos and prompt.startswith(bos):
            prompt = prompt[len(bos):]  # tokenization adds BOS itself; never twice
        item: dict[str, Any] = {"prompt": prompt}
        embeds = [im for im in images if not isinstance(im, Image.Image)]
        if embeds:
            if len(embeds) != len(images):
                raise ValueError(f"messages[{i}]: got image and image_embeds parts in one conversation; expected "
                                 "one kind (as vLLM)")
            images = _joined_embeds(f"messages[{i}]", embeds)
        if embeds or images or videos:
            key = "image_embeds" if embeds else "image"
            item["multi_modal_data"] = {**({key: images} if embeds or images else {}),
                                        **({"video": videos} if videos else {})}
        inputs.append(item)
    return inputs
