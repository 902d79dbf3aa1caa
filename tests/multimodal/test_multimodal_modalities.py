"""The generic refusal of a modality a processor does not declare (mmkit/multimodal/modalities.py),
without a model: one message naming the prompt's index, the modality, the architecture and the
processor's supported modalities."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmkit.multimodal.parse import parse_prompt
from mmkit.multimodal import check_supported_modalities, prompt_modalities, supported_modalities

FRAMES = [Image.new("RGB", (8, 8), (10, 20, 30))] * 2
IMAGE = Image.new("RGB", (8, 8), (200, 0, 0))


def test_prompt_modalities():
    assert prompt_modalities(parse_prompt(0, "text")) == []
    assert prompt_modalities(parse_prompt(0, {"prompt": "x", "multi_modal_data": {"image": IMAGE}})) == ["image"]
    embeds = parse_prompt(0, {"prompt": "x", "multi_modal_data": {"image_embeds": torch.zeros(1, 4, 8)}})
    assert prompt_modalities(embeds) == ["image"]
    both = parse_prompt(0, {"prompt": "x", "multi_modal_data": {"image": IMAGE, "video": FRAMES}})
    assert prompt_modalities(both) == ["image", "video"]


def test_refusal_message_names_index_modality_architecture_and_supported():
    parsed = parse_prompt(3, {"prompt": "x", "multi_modal_data": {"image": IMAGE, "video": FRAMES}})
    with pytest.raises(ValueError) as info:
        check_supported_modalities(parsed, ("image",), "MyVLMForConditionalGeneration")
    assert str(info.value) == ("inputs[3].multi_modal_data: got a 'video'; MyVLMForConditionalGeneration takes "
                               "images only (its processor's supported_modalities: ['image'])")
    check_supported_modalities(parsed, ("image", "video"), "VideoVLM")  # both declared: accepted
    video_only = parse_prompt(0, {"prompt": "x", "multi_modal_data": {"image": IMAGE}})
    with pytest.raises(ValueError, match=r"^inputs\[0\]\.multi_modal_data: got an 'image'; V takes videos only "
                                         r"\(its processor's supported_modalities: \['video'\]\)$"):
        check_supported_modalities(video_only, ("video",), "V")
    check_supported_modalities(parse_prompt(0, "text only"), (), "TextOnly")  # no items: nothing to refuse


def test_undeclared_processor_is_image_only():
    class Declares:
        supported_modalities = ("image", "video")

    assert supported_modalities(Declares()) == ("image", "video")
    assert supported_modalities(object()) == ("image",)
