"""The multimodal input stage (mmkit/multimodal/): the item protocol every modality implements,
and the stage the engine hands to the scheduler and the runner at construction (nothing is
patched in afterwards; with prefetching, the HF processor's per-item work runs on its workers)."""

from __future__ import annotations

import threading

from PIL import Image

from conftest import get_llm, make_image
from mmkit import LLM, SamplingParams
from mmkit.multimodal import ImageItem, MultiModalItem
from mmkit.multimodal.stage import MultiModalInputStage

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _image_item(layout: str = "") -> ImageItem:
    return ImageItem(source=Image.new("RGB", (8, 6), (1, 2, 3)), width=8, height=6, layout=layout)


def test_every_item_type_implements_the_protocol():
    from mmkit.processors.qwen2_vl import VisionItem
    from mmkit.processors.spans import SpanItem

    image = _image_item()
    video = VisionItem("video", [image, _image_item()], (2, 2, 2), 2, {"fps": 2.0})
    span = SpanItem("image", [image], [5, 6, 7], {"do_image_splitting": False})
    for item, modality, options in ((image, "image", {}), (video, "video", {"fps": 2.0}),
                                    (span, "image", {"do_image_splitting": False})):
        assert isinstance(item, MultiModalItem)
        assert (item.modality, item.processor_options, item.layout) == (modality, options, "")
        assert len(item.content_hash()) == 64
    # The layout and the options are part of the hash: other layouts never share cache entries.
    assert _image_item("base_view").content_hash() != image.content_hash() == _image_item().content_hash()
    assert VisionItem("video", [image], (1, 2, 2), 1, {"fps": 1.0}).content_hash() != \
        VisionItem("video", [image], (1, 2, 2), 1, {"fps": 2.0}).content_hash()


def test_the_stage_is_wired_at_construction(tiny_ckpt):
    on = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=2)
    engine = on.llm_engine
    assert isinstance(engine.input_stage, MultiModalInputStage)
    assert engine.model_runner.input_stage is engine.input_stage
    assert engine.scheduler.preprocess is engine.input_stage and engine.prefetcher is engine.input_stage.prefetcher
    assert not hasattr(engine.model_runner, "mm_item_inputs")  # no hook to patch
    off = get_llm(tiny_ckpt, async_preprocess=False).llm_engine
    assert off.prefetcher is None and off.scheduler.preprocess is None
    assert off.model_runner.input_stage is off.input_stage


def test_with_prefetching_the_processor_runs_on_the_workers_only(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=64, preprocess_lookahead=2)
    processor = llm.llm_engine.input_processor
    original = processor.mm_item_inputs
    threads: list[str] = []
    lock = threading.Lock()

    def recording(item):
        with lock:
            threads.append(threading.current_thread().name)
        return original(item)

    processor.mm_item_inputs = recording
    batch = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(300 + i, 40 + i, 30)}} for i in range(6)]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert len(outs) == 6 and len(threads) == 6
    assert all(name.startswith("mmkit-preprocess") for name in threads), threads
    assert llm.llm_engine.prefetcher.num_inline == 0
