"""Placeholder spans come from what the checkpoint's processor writes, never from a count helper.

transformers 5.25 changed what several processors' `_get_num_multimodal_tokens` count (Pixtral,
Idefics3, SmolVLM, InternVL: only the rows that hold embeddings) while the prompts they write
stayed the same. Here every processor class's count helper lies (it reports fewer tokens than
the processor writes): mmkit's prompt must still be exactly the processor's `input_ids` for the
same text and image, and generation must run. A family that reads its span count from the
helper fails here.
"""

from __future__ import annotations

import pytest
from PIL import Image

from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint, tiny_architectures

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _lying_helper(original):
    def helper(self, *args, **kwargs):  # fewer tokens than the processor writes
        counts = original(self, *args, **kwargs) if original is not None else {}
        data = dict(counts) if isinstance(counts, dict) else dict(vars(counts))
        for key in ("num_image_tokens", "num_video_tokens"):
            if data.get(key) is not None:
                data[key] = [max(1, int(n) - 3) for n in data[key]]
        if data.get("num_image_patches") is not None:  # tiles / views (InternVL, Idefics3)
            data["num_image_patches"] = [int(n) + 1 for n in data["num_image_patches"]]
        return type(counts)(**data) if not isinstance(counts, dict) and original is not None else data
    return helper


@pytest.mark.parametrize("arch", tiny_architectures())
def test_prompt_equals_processor_output_when_the_count_helper_lies(arch, tmp_path_factory, monkeypatch):
    from transformers import AutoProcessor

    path = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
    hf = AutoProcessor.from_pretrained(path)
    cls = type(hf)
    monkeypatch.setattr(cls, "_get_num_multimodal_tokens",
                        _lying_helper(getattr(cls, "_get_num_multimodal_tokens", None)), raising=False)
    image = Image.new("RGB", (45, 37), (200, 30, 60))
    prompt = f"Look {hf.image_token} and say"
    expected = [int(t) for t in hf(text=[prompt], images=[image])["input_ids"][0]]

    llm = LLM(str(path), dtype="float32", seed=0)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 3
