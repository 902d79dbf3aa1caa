"""`mmkit.testing.build_tiny_checkpoint` (documented in the README as a stable user API):
every architecture it lists builds offline and generates with `LLM`, image prompts included."""

from __future__ import annotations

import pytest
from PIL import Image

from mmkit import LLM, SamplingParams
from mmkit.multimodal import supported_modalities
from mmkit.testing import build_tiny_checkpoint, tiny_architectures


def test_an_unknown_architecture_is_a_clear_error():
    assert tiny_architectures() == sorted(tiny_architectures()) and tiny_architectures()
    with pytest.raises(ValueError, match="no tiny builder"):
        build_tiny_checkpoint("NoSuchForConditionalGeneration", "/nonexistent")


@pytest.mark.parametrize("architecture", tiny_architectures())
def test_toy_checkpoint_generates(architecture, tmp_path):
    path = build_tiny_checkpoint(architecture, tmp_path / "ckpt")
    llm = LLM(model=str(path), dtype="float32", seed=0, max_num_seqs=4)
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is in the image?"}]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text_only, with_image = llm.generate("Hello", params, use_tqdm=False)[0], llm.chat(messages, params,
                                                                                       use_tqdm=False)[0]
    for out in (text_only, with_image):
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    # The image's placeholder was expanded to the model's image tokens: the prompt grew.
    assert len(with_image.prompt_token_ids) > len(llm.get_tokenizer()("What is in the image?").input_ids) + 4
    # A modality the family's processor does not declare is refused by the generic input path,
    # with one message (no family writes its own, none silently drops the video).
    supported = supported_modalities(llm.llm_engine.input_processor)
    if "video" not in supported:
        expected = (f"inputs[1].multi_modal_data: got a 'video'; {architecture} takes images only "
                    f"(its processor's supported_modalities: {list(supported)})")
        with pytest.raises(ValueError) as info:
            llm.generate(["Hello", {"prompt": "Hello", "multi_modal_data": {"video": [image, image]}}], params,
                         use_tqdm=False)
        assert str(info.value) == expected
        assert not llm.llm_engine.has_unfinished_requests()
