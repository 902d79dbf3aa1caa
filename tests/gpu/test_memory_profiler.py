"""The memory profiler's arithmetic (mmkit/worker/memory_profiler.py) with a fake device, and its
profiling step run on CPU with a tiny LLaVA (the dummy images through the real processor)."""

from __future__ import annotations

import logging

import pytest
import torch

from mmkit.worker.memory_profiler import (GiB, MemoryProfile, MemorySnapshot, needs_profile, profile_memory,
                                          profiling_step)


class FakeMemory:
    """80 GiB device; `allocate(n)` moves torch's counters as a run would."""

    def __init__(self, weights: int, non_torch: int) -> None:
        self.total, self.allocated, self.peak, self.non_torch = 80 * GiB, weights, weights, non_torch
        self.resets = 0

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def snapshot(self) -> MemorySnapshot:
        reserved = self.peak  # the caching allocator keeps the peak reserved
        return MemorySnapshot(self.total, self.total - reserved - self.non_torch, self.allocated, reserved, self.peak)

    def reset_peak(self) -> None:
        self.resets += 1
        self.peak = self.allocated


def test_profile_arithmetic():
    mem = FakeMemory(weights=14 * GiB, non_torch=GiB // 2)

    def run():  # 3 GiB of activations and 1 GiB of scratch KV at the peak, all freed after
        mem.allocate(4 * GiB)
        mem.allocate(-4 * GiB)

    profile = profile_memory(run, mem, 0.9, scratch_bytes=GiB)
    assert mem.resets == 1
    assert (profile.weights_bytes, profile.activation_peak_bytes) == (14 * GiB, 3 * GiB)
    assert profile.non_torch_bytes == GiB // 2
    assert profile.kv_cache_bytes == int(80 * GiB * 0.9) - 14 * GiB - 3 * GiB - GiB // 2
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # K+V, 32 layers, 16 tokens, 8 KV heads, head_dim 128, bf16
    assert profile.num_blocks(per_block) == profile.kv_cache_bytes // per_block
    assert "weights 14.00 GiB, peak activations 3.00 GiB, non-torch 0.50 GiB, KV cache 54.50 GiB" in profile.describe()


def test_no_room_is_a_clear_error():
    profile = MemoryProfile(total_bytes=16 * GiB, gpu_memory_utilization=0.5, weights_bytes=7 * GiB,
                            activation_peak_bytes=2 * GiB, non_torch_bytes=0)
    assert profile.kv_cache_bytes == -GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.5 leaves no room for one KV block of 1024 bytes "
                                         r"\(total 16.00 GiB x 0.5 = 8.00 GiB: weights 7.00 GiB.*set num_kv_blocks"):
        profile.num_blocks(1024)


def test_needs_profile_only_on_cuda_without_a_given_size(tiny_ckpt):
    from mmkit import EngineArgs

    config = EngineArgs(model=str(tiny_ckpt), device="cpu").create_engine_config()
    assert not needs_profile(config)


def test_profiling_step_runs_the_worst_step_on_cpu(gqa_tied_ckpt):
    """The step the profile measures runs (chunk of max_num_batched_tokens, images through the
    processor and the vision tower) and reports its scratch KV bytes."""
    from mmkit import LLM

    llm = LLM(str(gqa_tied_ckpt), dtype="float32", max_num_batched_tokens=64, limit_mm_per_prompt={"image": 2},
              num_kv_blocks=16)
    runner = llm.llm_engine.model_runner
    calls = []
    encode = runner.model.embed_multimodal
    runner.model.embed_multimodal = lambda items: calls.append(len(items)) or encode(items)
    try:
        run, scratch = profiling_step(runner)
        run()
    finally:
        del runner.model.embed_multimodal
    mc = runner.config.model
    assert scratch == (64 // runner.block_size) * 2 * mc.num_layers * runner.block_size * mc.num_kv_heads * mc.head_dim * 4
    assert calls == [2]


@pytest.mark.cuda
def test_cuda_engine_logs_its_profile(gqa_tied_ckpt, caplog):
    from mmkit import LLM

    with caplog.at_level(logging.INFO, logger="mmkit.memory"):
        llm = LLM(str(gqa_tied_ckpt), dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    from mmkit.worker.kv_cache import bytes_per_block

    runner = llm.llm_engine.model_runner
    profile = runner.memory_profile
    assert profile is not None and profile.activation_peak_bytes > 0 and profile.weights_bytes > 0
    assert runner.num_blocks == profile.num_blocks(bytes_per_block(runner.config.model, runner.block_size))
    assert "mmkit memory profile: total" in caplog.text
    torch.cuda.empty_cache()
