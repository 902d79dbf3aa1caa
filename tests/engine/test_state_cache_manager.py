"""The per-request state cache of hybrid decoders, alone: slots handed out once, freed on finish,
abort and preemption, never shared by two live sequences, exhaustion a clear error; the runner's
tensors zeroed for a new owner; the scheduler taking and giving back slots."""

from __future__ import annotations

import random

import pytest
import torch

from mmkit.engine.state_cache_manager import StateCacheManager
from mmkit.layers.state_spec import StateSpec
from mmkit.worker.state_cache import StateCache


def test_allocate_free_and_exhaustion():
    m = StateCacheManager(3, bytes_per_slot=100)
    slots = [m.allocate(seq_id) for seq_id in (10, 11, 12)]
    assert sorted(slots) == [0, 1, 2] and m.num_free_slots == 0 and not m.can_allocate()
    assert m.allocate(11) == slots[1]  # a holder asking again keeps its slot
    with pytest.raises(RuntimeError, match=r"state cache: all 3 slots are held.*sequence 13 cannot get one"):
        m.allocate(13)
    assert m.num_free_slots == 0 and m.slot_of(13) is None  # the failed call changed nothing
    m.free(11)
    m.free(11)  # freeing twice (finish after abort) is harmless
    assert m.num_free_slots == 1 and m.allocate(13) == slots[1]
    assert m.metrics() == {"state_slots_total": 3, "state_slots_free": 0, "state_bytes_per_request": 100}
    with pytest.raises(ValueError, match="got 0 slots"):
        StateCacheManager(0, 1)


def test_no_slot_is_shared_by_two_live_sequences():
    rng = random.Random(0)
    m = StateCacheManager(8, 1)
    live: dict[int, int] = {}
    for step in range(2000):
        if live and (rng.random() < 0.5 or not m.can_allocate()):
            seq_id = rng.choice(sorted(live))
            m.free(seq_id)
            del live[seq_id]
        else:
            live[step] = m.allocate(step)
        assert len(set(live.values())) == len(live)  # distinct slots
        assert m.num_free_slots == 8 - len(live)


def test_spec_bytes_and_runner_tensors():
    spec = StateSpec(layer_ids=(0, 2), conv_channels=10, conv_width=3, recurrent_shape=(4, 8, 6))
    assert spec.bytes_per_slot(torch.bfloat16) == 2 * (10 * 3 * 2 + 4 * 8 * 6 * 4)
    cache = StateCache(spec, num_slots=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    conv, rec = cache.layer(2)
    assert conv.shape == (4, 10, 3) and conv.dtype == torch.bfloat16
    assert rec.shape == (4, 4, 8, 6) and rec.dtype == torch.float32  # the recurrent state stays float32
    assert cache.num_bytes == 4 * spec.bytes_per_slot(torch.bfloat16)
    for t in (*cache.conv, *cache.recurrent):
        t.fill_(1)
    cache.reset(1)  # a new owner of slot 1 starts from zeros; the other slots are untouched
    for t in (*cache.conv, *cache.recurrent):
        assert t[1].abs().sum() == 0 and t[0].min() == 1 and t[2].min() == 1


def test_scheduler_takes_and_returns_slots(tmp_path):
    """Through the engine: every sequence the runner gets holds its own slot; abort and finish
    give them back."""
    from mmkit import LLMEngine, EngineArgs, SamplingParams
    from mmkit.testing import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("Qwen3_5ForConditionalGeneration", tmp_path / "q", text_layers=2)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(ckpt), dtype="float32", max_num_seqs=3))
    manager = engine.state_cache_manager
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", f"prompt number {i}", params)
    engine.step()
    running = list(engine.scheduler.running)
    slots = [manager.slot_of(s.seq_id) for s in running]
    assert len(running) == 3 and sorted(slots) == [0, 1, 2]  # two wait: no slot for them yet
    engine.abort_request(["r1"])
    assert manager.num_free_slots == 1
    while engine.has_unfinished_requests():
        engine.step()
        live = [manager.slot_of(s.seq_id) for s in engine.scheduler.running]
        assert None not in live and len(set(live)) == len(live)
    assert manager.num_free_slots == 3
