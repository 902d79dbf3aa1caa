"""OpenAI-style chat messages -> prompts rendered with the checkpoint's chat template.

A message's content is a string or a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}` (a `data:image/...;base64,` URI, a local
path, a `file://` URL or http(s)) and `{"type": "image", "image": PIL.Image}`; for video models also
`{"type": "video_url", "video_url": {"url": "clip.mp4" | [frame, ...]}}` and `{"type": "video",
"video": frames}`. Images and videos are collected in order of appearance; the template places
one placeholder per part.

Tool calling: an assistant message may carry `tool_calls` (its `content` then may be None or
absent), and a `role: "tool"` message (with its `tool_call_id`) holds the tool's result, a string
or parts, images included. They reach the template as transformers' `apply_chat_template` gets
them: None-valued keys dropped, a tool result's string content left a string.
"""

from __future__ import annotations

from typing import Any, Sequence

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
                       media: MediaConnector | None = None) -> tuple[Conversation, list[Image.Image]]:
    """Validate one conversation; return it in the HF template's form and its images. Video
    parts are accepted only when `videos` is a list (a video model); they are appended to it."""
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
    if kind in ("video_url", "video") and videos is not None:
        from mmkit.multimodal.video_io import load_video

        spec = part.get(kind)
        source = spec.get("url") if kind == "video_url" and isinstance(spec, dict) else spec
        if kind == "video" and not isinstance(source, (str, list, tuple)):
            videos.append(source)  # a (T, C, H, W) tensor, checked by the input parser
        else:
            videos.append(load_video(source, where=f"{where}.{kind}", media=media))
        return {"type": "video"}
    expected = "'text', 'image_url', 'image', 'video_url' or 'video'" if videos is not None \
        else "'text', 'image_url' or 'image' (this model takes no video)"
    raise ValueError(f"{where}.type: got {kind!r}; expected {expected}")


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
        if images or videos:
            item["multi_modal_data"] = {**({"image": images} if images else {}),
                                        **({"video": videos} if videos else {})}
        inputs.append(item)
    return inputs
