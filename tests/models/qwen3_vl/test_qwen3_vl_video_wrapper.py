"""A Qwen3-VL video placeholder written bare (`<|video_pad|>`) or wrapped as the chat template
writes it (`<|vision_start|><|video_pad|><|vision_end|>`), as text and as token ids: the prompt
ids are the installed transformers processor's `input_ids` and the greedy ids its model's own
`generate` (float32). transformers 5.25 collapses the wrapper before expanding (every frame
pair already has its own `<|vision_start|>...<|vision_end|>`), 5.17-5.24 keep it; mmkit follows
whichever is installed."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from packaging.version import Version

from qwen_ref import hf_inputs
from test_qwen3_vl import FRAMES, ckpt, greedy, hf_greedy  # noqa: F401 - ckpt is the shared fixture
from mmkit import LLM
from mmkit.multimodal.parse import parse_prompt

WRAPPED = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe this video.<|im_end|>\n"
           "<|im_start|>assistant\n")
BARE = "<|im_start|>user\n<|video_pad|>Describe this video.<|im_end|>\n<|im_start|>assistant\n"


def test_bare_and_wrapped_video_placeholders_equal_transformers(ckpt):
    llm = LLM(str(ckpt), dtype="float32")
    tokenizer = llm.get_tokenizer()
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    batch, refs = [], []
    for prompt in (BARE, WRAPPED):
        batch += [{"prompt": prompt, "multi_modal_data": {"video": FRAMES}},
                  {"prompt_token_ids": tokenizer(prompt).input_ids, "multi_modal_data": {"video": FRAMES}}]
        refs += [prompt, prompt]
    outs = llm.generate(batch, greedy(), use_tqdm=False)
    starts = {}
    for out, prompt in zip(outs, refs):
        hf_ids = hf_inputs(ckpt, prompt, videos=FRAMES)["input_ids"][0].tolist()
        assert list(out.prompt_token_ids) == hf_ids, prompt
        assert list(out.outputs[0].token_ids) == hf_greedy(ckpt, prompt, videos=FRAMES), prompt
        starts[prompt] = list(out.prompt_token_ids).count(start)
    # 8 frames at 24 fps sampled at 12: 4 frames, 2 temporal patches, each in its own pair.
    assert starts[BARE] == 2
    if Version(transformers.__version__) >= Version("5.25"):
        assert starts[WRAPPED] == 2  # the chat template's outer pair is collapsed, as transformers does


def test_scheduling_refuses_a_span_the_processor_no_longer_writes(ckpt):
    """The processor call on the real frames must write the text the prompt was expanded with."""
    proc = LLM(str(ckpt), dtype="float32", num_kv_blocks=8).llm_engine.input_processor
    video, = proc.process(parse_prompt(0, {"prompt": BARE, "multi_modal_data": {"video": FRAMES}})).images
    assert proc.mm_item_inputs(video)["span_token_ids"].tolist() == video.span.token_ids
    stale = dataclasses.replace(video, replacement=video.replacement.replace("<0.0 seconds>", "<0.1 seconds>"))
    with pytest.raises(ValueError, match=r"inputs\[0\]\.multi_modal_data\.video\[0\]: .*refusing to misalign"):
        proc.mm_item_inputs(stale)
