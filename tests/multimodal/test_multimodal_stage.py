"""The multimodal input stage (mmkit/multimodal/): the item protocol every modality implements,
and the stage the engine hands to the scheduler and the runner at construction (nothing is
patched in afterwards; with prefetching, the HF processor's per-item work runs on its workers)."""

from __future__ import annotations

import threading

from PIL import Image

from conftest import get_llm, hf_greedy, make_image
from mmkit.engine.scheduler import PreprocessTracker
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
    # The engine alone owns the stage: the scheduler sees readiness through PreprocessTracker
    # (is_ready / requeue: nothing that blocks) and the runner gets item inputs in the step.
    assert not hasattr(engine.model_runner, "input_stage") and not hasattr(engine.model_runner, "mm_item_inputs")
    assert engine.scheduler.preprocess is engine.input_stage and engine.prefetcher is engine.input_stage.prefetcher
    assert {"is_ready", "requeue"} <= set(PreprocessTracker.__dict__)
    assert not {"wait", "start_now"} & set(PreprocessTracker.__dict__)
    off = get_llm(tiny_ckpt, async_preprocess=False).llm_engine
    assert off.prefetcher is None and off.scheduler.preprocess is None
    assert not hasattr(off.model_runner, "input_stage")


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


class _ProcessorCalls:
    """Records every per-item processor call: its thread, and whether `LLMEngine.step()` was on
    the stack of the engine thread when it ran (the HF processor must never run at step time)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        engine, processor = llm.llm_engine, llm.llm_engine.input_processor
        self.calls: list[tuple[str, bool]] = []
        self._in_step = False
        self._lock = threading.Lock()
        original_step, original_inputs = engine.step, processor.mm_item_inputs

        def step():
            self._in_step = True
            try:
                return original_step()
            finally:
                self._in_step = False

        def mm_item_inputs(item):
            name = threading.current_thread().name
            with self._lock:
                self.calls.append((name, self._in_step and threading.current_thread() is threading.main_thread()))
            return original_inputs(item)

        monkeypatch.setattr(engine, "step", step)
        monkeypatch.setattr(processor, "mm_item_inputs", mm_item_inputs)

    @property
    def in_step(self) -> list[tuple[str, bool]]:
        return [call for call in self.calls if call[1]]


def _preempting_batch() -> tuple[list[dict], list[SamplingParams]]:
    """Six image requests that do not fit together in 12 blocks of 16 tokens (each fits alone)."""
    batch = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(500 + i, 40 + i, 30)}} for i in range(6)]
    return batch, [SamplingParams(temperature=0, max_tokens=30 + 5 * i, ignore_eos=True) for i in range(6)]


def _check_greedy(outs, batch, params, tiny_ckpt) -> None:
    """Token ids equal the roomy engine's, and transformers' for the first request."""
    roomy = get_llm(tiny_ckpt).generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    image = batch[0]["multi_modal_data"]["image"]
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(str(tiny_ckpt), PROMPT, [image], max_new_tokens=30,
                                                           ignore_eos=True)


def test_without_prefetching_the_processor_runs_when_requests_are_added(tiny_ckpt, monkeypatch):
    # encoder_cache_memory=0: a preempted request's items must be encoded again from inputs.
    llm = LLM(str(tiny_ckpt), dtype="float32", async_preprocess=False, num_kv_blocks=12, block_size=16,
              encoder_cache_memory=0)
    calls = _ProcessorCalls(llm, monkeypatch)
    batch, params = _preempting_batch()
    outs = llm.generate(batch, params, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    # Once per item, on the caller's thread when the request was added (kept through preemption).
    assert len(calls.calls) == 6 and calls.in_step == [], calls.calls
    assert not llm.llm_engine.input_stage._computed  # released when the requests ended
    _check_greedy(outs, batch, params, tiny_ckpt)


def test_a_preempted_request_gets_its_items_from_the_workers_again(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=2, num_kv_blocks=12, block_size=16,
              encoder_cache_memory=0)
    calls = _ProcessorCalls(llm, monkeypatch)
    batch, params = _preempting_batch()
    outs = llm.generate(batch, params, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert len(calls.calls) > 6  # some items were prepared again for a recomputed request
    assert all(name.startswith("mmkit-preprocess") for name, _ in calls.calls), calls.calls
    assert calls.in_step == [] and llm.llm_engine.prefetcher.num_inline == 0
    assert not llm.llm_engine.prefetcher._live and not llm.llm_engine.input_stage._items
    _check_greedy(outs, batch, params, tiny_ckpt)


def test_a_step_carries_its_items_model_inputs(tiny_ckpt, monkeypatch):
    """vLLM's mm_features: each encoded item's inputs travel in the scheduler output, attached by
    the engine; the runner encodes exactly what it was given."""
    from mmkit import SamplingParams

    llm = get_llm(tiny_ckpt, async_preprocess=False)
    engine = llm.llm_engine
    seen = []
    original = engine.model_runner.execute_model

    def execute(sched):
        seen.extend((e.request_id, e.mm_kwargs) for e in sched.encoder_inputs)
        return original(sched)

    monkeypatch.setattr(engine.model_runner, "execute_model", execute)
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": make_image(5)}}],
                 SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(seen) == 1 and set(seen[0][1]) == {"pixel_values"} and seen[0][1]["pixel_values"].dim() == 4


def test_the_samples_of_one_prompt_share_its_processor_work(tiny_ckpt, monkeypatch):
    """n > 1 fans out into n scheduler requests with one prompt: the processor runs once per
    item, not once per sample (with and without prefetching, through a preemption), and
    nothing of the request is kept afterwards."""
    image = make_image(77, 40, 30)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=40, ignore_eos=True)
    inp = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    reference = get_llm(tiny_ckpt).generate(inp, params, use_tqdm=False)[0]
    for async_preprocess in (True, False):
        # encoder_cache_memory=0: every sample encodes its image from the shared inputs.
        llm = LLM(str(tiny_ckpt), dtype="float32", async_preprocess=async_preprocess, preprocess_lookahead=2,
                  encoder_cache_memory=0)
        calls = _ProcessorCalls(llm, monkeypatch)
        out = llm.generate(inp, params, use_tqdm=False)[0]
        assert len(calls.calls) == 1 and calls.in_step == [], calls.calls
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
        stage = llm.llm_engine.input_stage
        assert not stage._items and not stage._computed and not stage._key and not stage._members
        if async_preprocess:
            assert not llm.llm_engine.prefetcher._live and llm.llm_engine.prefetcher.num_inline == 0
        monkeypatch.undo()


def test_a_preempted_sample_brings_the_shared_items_back(tiny_ckpt, monkeypatch):
    """Samples of one image prompt that do not fit together: the preempted one is recomputed
    from the workers' results again (never inline at step time), and the ids are the roomy
    engine's."""
    image = make_image(78, 40, 30)
    params = SamplingParams(temperature=1.0, seed=9, n=4, max_tokens=60, ignore_eos=True)
    inp = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    reference = get_llm(tiny_ckpt).generate(inp, params, use_tqdm=False)[0]
    llm = LLM(str(tiny_ckpt), dtype="float32", preprocess_lookahead=2, num_kv_blocks=12, block_size=16,
              encoder_cache_memory=0)
    calls = _ProcessorCalls(llm, monkeypatch)
    out = llm.generate(inp, params, use_tqdm=False)[0]
    assert llm.get_metrics()["num_preemptions"] > 0
    assert calls.in_step == [] and llm.llm_engine.prefetcher.num_inline == 0
    assert all(name.startswith("mmkit-preprocess") for name, _ in calls.calls), calls.calls
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    stage = llm.llm_engine.input_stage
    assert not llm.llm_engine.prefetcher._live and not stage._items and not stage._key
