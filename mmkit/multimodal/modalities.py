"""Which modalities a prompt brings, and the one refusal of a modality a processor does not take.

A family's processor declares `supported_modalities` ("image", "video"); the generic input path
checks every prompt against it before the processor sees the prompt, so no family writes its own
"this model takes images only" branch (and a family that forgets one cannot silently drop a
video).
"""

from __future__ import annotations

from typing import Any, Sequence

_NOUNS = {"image": "images", "video": "videos"}


def supported_modalities(input_processor: Any) -> tuple[str, ...]:
    """What a processor declares (`InputProcessor.supported_modalities`); one that declares
    nothing is taken to be image-only, as every family before video was."""
    return tuple(getattr(input_processor, "supported_modalities", ("image",)))


def prompt_modalities(parsed: Any) -> list[str]:
    """The modalities a parsed prompt holds, in a fixed order (images or image embeddings are
    "image"; a `multi_modal_data["video"]` value is "video")."""
    found = []
    if parsed.images or parsed.image_embeds is not None:
        found.append("image")
    if parsed.video_data is not None:
        found.append("video")
    return found


def check_supported_modalities(parsed: Any, supported: Sequence[str], architecture: str) -> None:
    """`ValueError` naming the prompt's index, the modality, the architecture and what its
    processor supports, for the first modality of `parsed` that `supported` lacks."""
    for modality in prompt_modalities(parsed):
        if modality not in supported:
            takes = " and ".join(_NOUNS.get(m, m) for m in supported) or "text"
            article = "an" if modality[:1] in "aeiou" else "a"
            raise ValueError(
                f"inputs[{parsed.index}].multi_modal_data: got {article} '{modality}'; {architecture} takes {takes} only "
                f"(its processor's supported_modalities: {list(supported)})"
            )
