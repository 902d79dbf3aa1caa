"""KV cache sizing and allocation (done once, when the engine is built)."""

from __future__ import annotations

import contextlib
import functools

import torch

from mmkit import envs
from mmkit.config import CacheConfig, ModelConfig
from mmkit.layers.attention import kv_cache_shape

_CPU_DEFAULT_LIMIT = 4 << 30  # bytes


def kv_layer_ids(model: ModelConfig) -> list[int]:
    """Decoder layers with a KV cache: all but a hybrid decoder's state layers."""
    spec = model.capabilities.state_spec
    state_layers = set(spec.layer_ids) if spec is not None else set()
    return [i for i in range(model.num_layers) if i not in state_layers]


def state_bytes(model: ModelConfig, max_num_seqs: int) -> int:
    """Bytes of a hybrid decoder's per-request state slots (one per sequence that can run)."""
    spec = model.capabilities.state_spec
    return 0 if spec is None else max_num_seqs * spec.bytes_per_slot(model.dtype)


def bytes_per_block(model: ModelConfig, block_size: int) -> int:
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * len(kv_layer_ids(model)) * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(model: ModelConfig, cache: CacheConfig, max_num_seqs: int) -> int:
    """`num_kv_blocks` if given; else `kv_cache_memory`; else a device-dependent default."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = bytes_per_block(model, cache.block_size)
    # A hybrid decoder's state slots come out of the same memory budget as the KV blocks.
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory - state_bytes(model, max_num_seqs)
    elif model.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(model.device)
        budget = int(free * cache.gpu_memory_utilization) - state_bytes(model, max_num_seqs)
    else:
        blocks_per_seq = -(-model.max_model_len // cache.block_size)
        budget = min(max_num_seqs * blocks_per_seq * per_block, _CPU_DEFAULT_LIMIT)
    num_blocks = budget // per_block
    if num_blocks < 1 and state_bytes(model, max_num_seqs):
        raise ValueError(
            f"kv_cache_memory: after the hybrid decoder's {max_num_seqs} per-request state slots "
            f"(max_num_seqs x {state_bytes(model, 1)} bytes) no KV block of {per_block} bytes is left; "
            f"give more memory or lower max_num_seqs"
        )
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes hold no KV block of {per_block} bytes "
            f"(block_size={cache.block_size}); give more memory or set num_kv_blocks"
        )
    return int(num_blocks)


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int,
                       preallocate: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # One (K, V) pair per layer: [num_kv_heads, num_blocks, block_size, head_dim] (heads first,
    # see mmkit/layers/attention.py). Zero-filled: padded positions are masked, and a zero
    # (never NaN) value times a zero weight keeps the output finite.
    shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_dim)
    zeros = torch.zeros
    if model.device.type == "cpu":
        # A preallocated cache commits every page at start-up anyway, so 2 MiB pages cost no
        # memory there, and decode attention reads blocks scattered over GBs, where 4 KiB pages
        # mean a TLB miss on nearly every block: 1.06x decode-heavy bf16 throughput with them
        # (benchmarks/HISTORY.md, round 5c). A lazy cache keeps 4 KiB pages (_lazy_zeros).
        forced = envs.MMKIT_KV_HUGEPAGES  # 1 / 0 for A/B measurements
        hugepages = preallocate if forced is None else forced
        zeros = functools.partial(_lazy_zeros, hugepages=hugepages)
    kv_layers = set(kv_layer_ids(model))
    none = torch.empty(0, dtype=model.dtype, device=model.device)  # a hybrid's state layer: no KV
    caches = [
        (zeros(shape, dtype=model.dtype, device=model.device),
         zeros(shape, dtype=model.dtype, device=model.device)) if i in kv_layers else (none, none)
        for i in range(model.num_layers)
    ]
    if preallocate and model.device.type == "cpu":
        # Writing the zeros commits every page now, on torch's threads. Committing a fresh page
        # costs microseconds (1.5-9 us on the benchmark host), and lazily it is paid inside the
        # step that first writes a block, on one thread: ~1 s of a 10 s decode-heavy run
        # (benchmarks/README.md, round 4j). Blocks freed with a prefix-cache hash are kept, so
        # a lazy cache keeps taking fresh blocks until the whole budget has been written once.
        for pair in caches:
            for cache in pair:
                cache.zero_()
    return caches


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                hugepages: bool = False) -> torch.Tensor:
    """Zeros whose pages become resident only when written (CPU).

    `torch.zeros` memsets the whole cache at start-up, so the process holds the full KV
    budget (4 GiB by default) from the first second. `numpy.zeros` is `calloc`: a large
    block comes straight from fresh, kernel-zeroed pages, and a page is committed the first
    time a block in it is written. Resident memory then follows the blocks actually used
    (vLLM's CPU backend reserves its whole KV space up front instead).

    NOTE: numpy advises transparent huge pages for large arrays; then a write commits 2 MiB,
    not 4 KiB. A block is 1 KiB per head and layer in the heads-first layout, so every block
    in use pinned a 2 MiB page per (head, layer, K/V): on the 30-layer benchmark the decode-
    heavy run held ~300 MB more than its blocks. A lazy cache is allocated without that advice
    (`hugepages` False); a preallocated one, whose every page is committed at once, with it.

    NOTE: only a tensor past glibc's mmap threshold is sure to be lazy. The threshold rises
    (up to 32 MiB) as the process frees large blocks, and a smaller calloc may then reuse heap
    memory, which it memsets: still zeros, only resident at once. A real cache's per-layer
    tensors are that large; tiny test caches may not be."""
    import numpy as np

    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    with _numpy_hugepages(hugepages):
        storage = np.zeros(numel, dtype={1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[elem])
    return torch.from_numpy(storage).view(dtype).view(shape)


@contextlib.contextmanager
def _numpy_hugepages(enabled: bool):
    """numpy's madvise(MADV_HUGEPAGE) for its large allocations on or off within the block
    (a no-op where numpy has no such switch)."""
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)
    switch = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if switch is None:
        yield
        return
    previous = switch(enabled)
    try:
        yield
    finally:
        switch(previous)
