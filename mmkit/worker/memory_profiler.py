"""Memory profiling before the KV cache is sized (CUDA), as vLLM's `determine_available_memory`.

After the weights load, one profiling forward runs the worst step the config allows: the
largest prefill chunk (`max_num_batched_tokens` tokens, at most `max_model_len`) after
encoding the largest image batch (`limit_mm_per_prompt["image"]` images, dummy gray ones
through the checkpoint's own processor), and the LM head over `max_num_seqs` rows. Its peak
is what a step needs beside the cache. Then

    kv_cache_bytes = total * gpu_memory_utilization - weights - peak activations - non-torch

where non-torch memory is what the process holds outside torch's allocator (CUDA context,
cuBLAS workspaces: device used minus torch reserved). The figures are logged at start
(`MemoryProfile.describe`). `num_kv_blocks` or `kv_cache_memory` skip the profile; the CPU
sizing is unchanged (`kv_cache.num_blocks_for`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

logger = logging.getLogger("mmkit.memory")

GiB = 1 << 30


@dataclass(frozen=True)
class MemorySnapshot:
    total: int  # device memory in bytes
    free: int  # free on the device (every process)
    torch_allocated: int
    torch_reserved: int
    torch_peak: int  # max allocated since the last reset


class DeviceMemory(Protocol):
    def snapshot(self) -> MemorySnapshot: ...

    def reset_peak(self) -> None: ...


class CudaMemory:
    """`DeviceMemory` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free, torch.cuda.memory_allocated(self.device),
                              torch.cuda.memory_reserved(self.device), torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int

    @property
    def kv_cache_bytes(self) -> int:
        budget = int(self.total_bytes * self.gpu_memory_utilization)
        return budget - self.weights_bytes - self.activation_peak_bytes - self.non_torch_bytes

    def num_blocks(self, bytes_per_block: int) -> int:
        """KV blocks that fit; a `ValueError` with the figures when not even one does."""
        blocks = max(self.kv_cache_bytes, 0) // bytes_per_block
        if blocks < 1:
            raise ValueError(f"gpu_memory_utilization: {self.gpu_memory_utilization} leaves no room for one KV block "
                             f"of {bytes_per_block} bytes ({self.describe()}); raise gpu_memory_utilization, lower "
                             f"max_num_batched_tokens or limit_mm_per_prompt, or set num_kv_blocks")
        return int(blocks)

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        return (f"total {gib(self.total_bytes)} x {self.gpu_memory_utilization} = "
                f"{gib(int(self.total_bytes * self.gpu_memory_utilization))}: weights {gib(self.weights_bytes)}, "
                f"peak activations {gib(self.activation_peak_bytes)}, non-torch {gib(self.non_torch_bytes)}, "
                f"KV cache {gib(max(self.kv_cache_bytes, 0))}")


def profile_memory(run: Callable[[], None], memory: DeviceMemory, gpu_memory_utilization: float,
                   scratch_bytes: int = 0) -> MemoryProfile:
    """Run `run` (the profiling forward) once and turn the memory figures into a profile.

    Called after the weights load: what torch holds before the run is the weights.
    `scratch_bytes`: allocations of the run that are not activations (the temporary KV blocks
    it writes), taken off its peak."""
    memory.reset_peak()
    before = memory.snapshot()
    run()
    after = memory.snapshot()
    peak = max(0, after.torch_peak - before.torch_allocated - scratch_bytes)
    non_torch = max(0, (after.total - after.free) - after.torch_reserved)
    return MemoryProfile(after.total, gpu_memory_utilization, before.torch_allocated, peak, non_torch)


def profiling_step(runner) -> tuple[Callable[[], None], int]:
    """The worst step of `runner`'s config as a callable, and its scratch bytes (its KV blocks)."""
    from mmkit.layers.attention import AttentionMetadata, PrefillChunk
    from mmkit.layers.attention_backend import attach_backend
    from mmkit.worker.kv_cache import allocate_kv_caches, bytes_per_block

    config = runner.config
    mc, sc = config.model, config.scheduler
    num_tokens = min(sc.max_num_batched_tokens, mc.max_model_len)
    bs = runner.block_size
    num_blocks = -(-num_tokens // bs)
    device = runner.device

    def run() -> None:
        caches = allocate_kv_caches(mc, num_blocks, bs)
        num_images = int(config.limit_mm_per_prompt.get("image", 0))
        if num_images:
            runner.model.embed_multimodal(dummy_image_inputs(runner, num_images))
        table = torch.arange(num_blocks, device=device)
        meta = AttentionMetadata(slot_mapping=torch.arange(num_tokens, device=device), block_size=bs,
                                 prefills=[PrefillChunk(0, num_tokens, num_tokens, table)])
        attach_backend(meta, runner.attention_backend, num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        if runner.capabilities.uses_mrope:
            positions = positions.expand(3, -1)
        with torch.inference_mode():
            hidden = runner.model(runner.model.embed_tokens(ids), positions, caches, meta)
            rows = min(sc.max_num_seqs, num_tokens)
            runner.model.compute_logits(hidden[:rows]).float().log_softmax(-1)  # the sampler's widest pass
        del caches, hidden

    return run, num_blocks * bytes_per_block(mc, bs)


def dummy_image_inputs(runner, count: int) -> list[dict]:
    """`count` gray images through the checkpoint's processor, as `embed_multimodal` takes them."""
    from PIL import Image

    from mmkit.multimodal.items import ImageItem

    side = int(getattr(getattr(runner.config.model.hf_config, "vision_config", None), "image_size", 0) or 336)
    image = Image.new("RGB", (side, side), (128, 128, 128))
    processor = runner.input_processor
    inputs = processor.mm_item_inputs(ImageItem(source=image, width=side, height=side, where="memory profile"))
    return [{k: v.to(runner.device) for k, v in inputs.items()} for _ in range(count)]


def profiled_num_blocks(runner) -> int:
    """KV blocks for a CUDA runner without `num_kv_blocks`/`kv_cache_memory`: profile, log, size."""
    from mmkit.worker.kv_cache import bytes_per_block, state_bytes

    run, scratch = profiling_step(runner)
    profile = profile_memory(run, CudaMemory(runner.device), runner.config.cache.gpu_memory_utilization, scratch)
    config = runner.config
    per_block = bytes_per_block(config.model, runner.block_size)
    num_blocks = min(profile.num_blocks(per_block), max_useful_blocks(config))
    # A hybrid decoder's state slots (allocated after the profile) come out of the same share.
    state = state_bytes(config.model, config.scheduler.max_num_seqs)
    if state:
        num_blocks -= -(-state // per_block)
        if num_blocks < 1:
            raise ValueError(f"gpu_memory_utilization: after the hybrid decoder's per-request state slots ({state} "
                             "bytes for max_num_seqs) no KV block is left; lower max_num_seqs or raise it")
    logger.info("mmkit memory profile: %s -> %d KV blocks of %d tokens", profile.describe(), num_blocks,
                runner.block_size)
    runner.memory_profile = profile
    return num_blocks


def max_useful_blocks(config) -> int:
    """Blocks for `max_num_seqs` sequences of `max_model_len` tokens: more can never be used at
    once. NOTE: it caps a tiny model's cache on a large GPU (millions of blocks otherwise, and
    per-step metadata as wide as the cache); a 7B model's profiled size stays far below it."""
    blocks_per_seq = -(-config.model.max_model_len // config.cache.block_size)
    return config.scheduler.max_num_seqs * blocks_per_seq


def needs_profile(config) -> bool:
    cache = config.cache
    return config.model.device.type == "cuda" and cache.num_kv_blocks is None and cache.kv_cache_memory is None
