"""The multimodal model interface (models/interfaces.py) and encoder work scheduled by the
scheduler: merge by placeholder ranges, per-item embeddings, M-RoPE position rows, an encoder
cache smaller than one step's images."""

from types import SimpleNamespace

import pytest
import torch

from conftest import get_llm, make_image
from mmkit import LLM, SamplingParams
from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.models.interfaces import (PlaceholderRange, SupportsMultiModal, merge_multimodal_embeddings,
                                     placeholder_slices)
from mmkit.worker.model_runner import ModelRunner
from mmkit.worker.seq_state import Chunk

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _reference_merge(embeds, items, ranges, start, end, row):
    out = embeds.clone()
    for pos in range(start, end):
        for item, (offset, length) in zip(items, ranges):
            if offset <= pos < offset + length:
                out[row + pos - start] = item[pos - offset]
    return out


@pytest.mark.parametrize("start,end", [(0, 12), (2, 9), (4, 6), (9, 12), (0, 1)])
def test_merge_scatters_variable_length_items_of_a_chunk(start, end):
    ranges = [PlaceholderRange(1, 3), PlaceholderRange(5, 5)]  # items of 3 and 5 rows
    items = [torch.randn(3, 4), torch.randn(5, 4)]
    row = 2  # the chunk's first token is row 2 of the step
    embeds = torch.randn(row + end - start + 1, 4)
    expected = _reference_merge(embeds, items, ranges, start, end, row)
    slices = placeholder_slices(ranges, start, end, row)
    merged = merge_multimodal_embeddings(embeds.clone(), items, slices)
    assert torch.equal(merged, expected)
    assert sum(s.length for s in slices) == sum(
        max(0, min(end, o + n) - max(start, o)) for o, n in ranges)


def test_placeholder_range_is_a_tuple():
    assert PlaceholderRange(3, 16) == (3, 16)
    offset, length = PlaceholderRange(3, 16)
    assert (offset, length) == (3, 16)


def test_llava_implements_the_interface(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    model = llm.llm_engine.model_runner.model
    cfg = llm.llm_engine.config.model
    assert isinstance(model, SupportsMultiModal)
    assert type(model).get_num_placeholder_tokens(cfg.hf_config, (40, 30)) == cfg.capabilities.image_seq_length
    processor = llm.llm_engine.input_processor
    items = [processor.mm_item_inputs(SimpleNamespace(to_pil=lambda s=s: make_image(s))) for s in (1, 2)]
    embeds = model.embed_multimodal(items)
    assert len(embeds) == 2 and all(e.shape == (cfg.capabilities.image_seq_length, cfg.hidden_size) for e in embeds)
    batched = model.encode_images(torch.cat([i["pixel_values"] for i in items]))
    assert torch.equal(torch.stack(embeds), batched)


def test_mrope_positions_follow_the_processor_rows_then_index_plus_delta():
    table = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])  # [3, 5 prompt tokens]
    state = SimpleNamespace(mrope_positions=table, mrope_position_delta=-2)
    chunk = lambda start, end: Chunk(state, start, end)
    runner = SimpleNamespace(device=torch.device("cpu"))
    out = ModelRunner._mrope_positions(runner, [chunk(6, 7), chunk(1, 4), chunk(3, 7)])
    assert out.shape == (3, 1 + 3 + 4)
    assert out[:, 0].tolist() == [4, 4, 4]  # generated token 6 -> 6 + delta
    assert torch.equal(out[:, 1:4], table[:, 1:4])
    assert torch.equal(out[:, 4:6], table[:, 3:5])
    assert out[:, 6:].tolist() == [[3, 4]] * 3


def test_encoder_cache_manager_never_evicts_a_referenced_entry():
    cache = EncoderCacheManager(budget_bytes=100)
    cache.allocate("a", seq_id=1, num_bytes=60)
    assert not cache.can_allocate(60)  # "a" is referenced
    cache.release("a", 1)
    assert cache.can_allocate(60) and cache.has("a")  # unreferenced entries stay cached
    cache.allocate("b", seq_id=2, num_bytes=60)  # evicts "a"
    assert not cache.has("a") and cache.take_freed() == ("a",) and cache.take_freed() == ()
    cache.add_ref("b", 3)
    cache.release("b", 2)
    assert not cache.can_allocate(60)  # still referenced by 3
    assert cache.can_allocate(40)
    off = EncoderCacheManager(0)  # cache off: entries live only while referenced
    off.allocate("x", 1, 10**9)
    off.release("x", 1)
    assert not off.has("x") and off.take_freed() == ("x",)


def _vqa(seed, question="What is in the image?", num_images=1):
    images = [make_image(seed + i) for i in range(num_images)]
    return {"prompt": "USER: " + "<image>" * num_images + f"\n{question} ASSISTANT:",
            "multi_modal_data": {"image": images if num_images > 1 else images[0]}}


def test_step_with_more_images_than_the_encoder_cache_holds_completes(tiny_ckpt):
    cfg = get_llm(tiny_ckpt).llm_engine.config.model
    one_image = cfg.capabilities.image_seq_length * cfg.hidden_size * 4  # float32 bytes of one image
    batch = [_vqa(10 + 3 * i, num_images=1 + i % 2) for i in range(5)] + ["Write a haiku."]
    ref = [o.outputs[0].token_ids for o in get_llm(tiny_ckpt).generate(batch, GREEDY, use_tqdm=False)]
    # Half an image of cache, and chunks that end inside an image (chunked prefill).
    for kwargs in ({"encoder_cache_memory": one_image}, {"encoder_cache_memory": one_image // 2},
                   {"encoder_cache_memory": one_image, "max_num_batched_tokens": 10}):
        llm = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=False, **kwargs)
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, kwargs
        runner_cache = llm.llm_engine.model_runner.encoder_cache
        assert len(runner_cache) <= 1  # what the scheduler allowed, nothing more
        assert llm.llm_engine.model_runner.num_vision_calls == 7  # distinct images, each once

