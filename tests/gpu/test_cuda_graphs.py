"""CUDA-graph bookkeeping (mmkit/worker/cuda_graphs.py) with the CPU stand-in: capture sizes and
pad-up, persistent buffers reused across steps, block tables grown incrementally, slot mapping
and FlexAttention block lists computed from the buffers, the decode attention read through them
equal to a reference gather; the capture itself runs in the `cuda` tests."""

from __future__ import annotations

import pytest
import torch

from mmkit.layers.attention import write_kv
from mmkit.layers.flex_attention import flex_paged_attention
from mmkit.worker.cuda_graphs import DecodeBuffers, GraphRunner, capture_sizes, padded_size

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BS, NUM_BLOCKS, H, HKV, D = 4, 32, 4, 2, 8
NULL = NUM_BLOCKS  # the cache holds one more block: the null block
SIZES = [1, 2, 4, 8]


def test_capture_sizes_and_pad_up():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(10) == [1, 2, 4, 8, 16]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-1] == 512
    assert [padded_size(n, SIZES) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def _buffers(windows=(0,)):
    return DecodeBuffers(max_batch=8, max_blocks_per_seq=6, block_size=BS, num_cache_blocks=NUM_BLOCKS + 1,
                         null_block=NULL, device=torch.device("cpu"), windows=windows)


def _slots(tables, positions):
    return [t[p // BS] * BS + p % BS for t, p in zip(tables, positions)]


def test_buffers_reused_grown_incrementally_and_padded():
    buf = _buffers()
    ptrs = [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.block_tables, buf.slot_mapping)]
    tables = {10: [3, 7], 11: [5], 12: [9, 2, 4]}
    lens = {10: 6, 11: 3, 12: 9}  # tokens before this step's decode token

    def step(seq_ids):
        positions = [lens[s] for s in seq_ids]
        return buf.update(seq_ids, [100 + s for s in seq_ids], positions, [tables[s] for s in seq_ids], SIZES), positions

    up, pos = step([10, 11, 12])
    assert (up.num_decodes, up.padded, up.table_entries_written, up.rows_rewritten) == (3, 4, 6, 0)
    assert buf.slot_mapping[:3].tolist() == _slots([tables[s] for s in (10, 11, 12)], pos)
    assert buf.slot_mapping[3].item() == NULL * BS  # the padded row writes to the null block
    assert buf.input_ids[:4].tolist() == [110, 111, 112, 0]
    assert buf.seq_lens[:3].tolist() == [7, 4, 10]
    # Next step: 11 crosses into a new block (position 4): one table entry, nothing else.
    for s in lens:
        lens[s] += 1
    tables[11].append(8)
    up, pos = step([10, 11, 12])
    assert (up.table_entries_written, up.rows_rewritten) == (1, 0)
    assert buf.block_tables[1, :2].tolist() == [5, 8]
    assert buf.slot_mapping[:3].tolist() == _slots([tables[s] for s in (10, 11, 12)], pos)
    # 10 finishes: rows shift, the moved rows are rewritten, a stale tail goes back to null.
    up, pos = step([11, 12])
    assert (up.padded, up.rows_rewritten) == (2, 2)
    assert buf.block_tables[0, :3].tolist() == [5, 8, NULL] and buf.block_tables[1, :3].tolist() == [9, 2, 4]
    assert buf.slot_mapping[:2].tolist() == _slots([tables[11], tables[12]], pos)
    assert ptrs == [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.block_tables, buf.slot_mapping)]
    with pytest.raises(ValueError, match="decode batch of 9 is larger than the largest captured size 8"):
        buf.update(list(range(9)), [0] * 9, [1] * 9, [[1]] * 9, SIZES)


def _reference(q, k_cache, v_cache, tables, positions, scale, window):
    out = []
    for i, (table, p) in enumerate(zip(tables, positions)):
        keys = k_cache[:, table].reshape(HKV, -1, D)[:, :p + 1]
        vals = v_cache[:, table].reshape(HKV, -1, D)[:, :p + 1]
        k_pos = torch.arange(p + 1)
        keep = k_pos > p - window if window else torch.ones(p + 1, dtype=torch.bool)
        qs = q[i].view(HKV, H // HKV, D)
        s = torch.einsum("kgd,ktd->kgt", qs, keys) * scale
        s = s.masked_fill(~keep, float("-inf"))
        out.append(torch.einsum("kgt,ktd->kgd", s.softmax(-1), vals).reshape(H, D))
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 6])
def test_decode_attention_through_the_buffers_equals_reference(window):
    """Two steps on one persistent FlexMetadata (as a replayed graph sees them); the padded row
    writes only the null block."""
    buf = _buffers(windows=(window,))
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(HKV, NUM_BLOCKS + 1, BS, D, generator=g)
    v_cache = torch.randn(HKV, NUM_BLOCKS + 1, BS, D, generator=g)
    tables = [[3, 7, 1], [5], [9, 2, 4, 11]]
    positions = [8, 3, 12]  # rows 0 and 2 start a new block; row 1 does at the second step
    fm = None
    for _ in range(2):
        buf.update([1, 2, 3], [0, 0, 0], positions, tables, SIZES)
        fm = fm or buf.flex_metadata(4)  # built once for the size, its tensors updated in place
        k, v = torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g)
        before = k_cache[:, :NUM_BLOCKS].clone()
        write_kv(k_cache, v_cache, k, v, buf.slot_mapping[:4])
        changed = (k_cache[:, :NUM_BLOCKS] != before).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert sorted(changed) == sorted({t[p // BS] for t, p in zip(tables, positions)})
        q = torch.randn(4, H, D, generator=g)
        got = flex_paged_attention(q, k_cache, v_cache, fm, 0.4, sliding_window=window or None)
        torch.testing.assert_close(got[:3], _reference(q, k_cache, v_cache, tables, positions, 0.4, window))
        assert torch.isfinite(got[3]).all()
        positions = [p + 1 for p in positions]
        if positions[1] // BS >= len(tables[1]):
            tables[1].append(12)


def test_graph_runner_stand_in_pads_and_counts():
    calls = []

    def forward(padded):
        calls.append(padded)
        return torch.arange(padded * 2, dtype=torch.float32).view(padded, 2)

    runner = GraphRunner(SIZES, forward, torch.device("cpu"))
    runner.capture()  # nothing to capture on CPU
    assert runner.graphs == {} and calls == []
    out = runner.run(3, padded_size(3, SIZES))
    assert out.shape == (3, 2) and calls == [4]
    runner.run(1, 1)
    assert runner.num_replays == {1: 1, 2: 0, 4: 1, 8: 0}


@pytest.mark.cuda
def test_graph_replay_equals_eager_on_cuda():
    buf = DecodeBuffers(max_batch=8, max_blocks_per_seq=6, block_size=BS, num_cache_blocks=NUM_BLOCKS + 1,
                        null_block=NULL, device=torch.device("cuda"))
    k_cache = torch.randn(HKV, NUM_BLOCKS + 1, BS, D, device="cuda")
    v_cache = torch.randn(HKV, NUM_BLOCKS + 1, BS, D, device="cuda")
    q_all = torch.randn(8, H, D, device="cuda")
    from mmkit.layers.attention_backend import compiled_flex_attention

    metas = {s: buf.flex_metadata(s) for s in SIZES}

    def forward(padded):
        return flex_paged_attention(q_all[:padded], k_cache, v_cache, metas[padded], 0.4,
                                    attend=compiled_flex_attention())

    tables, positions = [[3, 7, 1], [5], [9, 2, 4, 11]], [9, 2, 13]
    buf.update([1, 2, 3], [0] * 3, positions, tables, SIZES)
    runner = GraphRunner(SIZES, forward, torch.device("cuda"))
    runner.capture()
    eager = forward(4)[:3].clone()
    torch.testing.assert_close(runner.run(3, 4), eager)
    positions = [p + 1 for p in positions]
    buf.update([1, 2, 3], [0] * 3, positions, tables, SIZES)  # same addresses, new contents
    torch.testing.assert_close(runner.run(3, 4), forward(4)[:3])


def test_engine_decode_steps_through_the_stand_in_equal_transformers(gqa_tied_ckpt):
    """A real engine (flex backend on CPU) whose decode steps run through DecodeGraphs' buffers and
    the stand-in GraphRunner: greedy ids equal transformers', padded sizes were used, and prefill
    steps stayed eager."""
    from conftest import hf_greedy, make_image
    from mmkit import LLM, SamplingParams

    llm = LLM(str(gqa_tied_ckpt), dtype="float32", attention_backend="flex", num_kv_blocks=40, max_num_seqs=3)
    runner = llm.llm_engine.model_runner
    assert runner.decode_graphs is None  # CPU: eager unless enabled by hand
    graphs = type_graphs().enable(runner)
    assert graphs.sizes == [1, 2, 3] and runner.kv_caches[0][0].shape[1] == 41
    prompt = "USER: <image>\nWhat is in the image? ASSISTANT:"
    imgs = [make_image(1), make_image(2), make_image(3)]
    inputs = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in imgs]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for out, im in zip(outs, imgs):
        assert out.outputs[0].token_ids == hf_greedy(gqa_tied_ckpt, prompt=prompt, images=im, max_new_tokens=10)
    assert sum(graphs.graph_runner.num_replays.values()) >= 9
    assert graphs.graph_runner.num_replays[3] > 0


def type_graphs():
    from mmkit.worker.cuda_graphs import DecodeGraphs

    return DecodeGraphs
