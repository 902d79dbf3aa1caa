"""The CPU KV cache commits memory only for the blocks written (calloc'd zero pages), and
reads as zeros like `torch.zeros` (padded positions must never hold NaN garbage)."""

import torch

from mmkit.worker.kv_cache import _lazy_zeros


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


def test_lazy_kv_cache_is_zero_writable_and_not_resident_until_written():
    before = _rss_mb()
    cache = _lazy_zeros((3, 8192, 16, 64), dtype=torch.bfloat16, device=torch.device("cpu"))  # 48 MiB
    big = _lazy_zeros((3, 65536, 16, 64), dtype=torch.float32, device=torch.device("cpu"))  # 768 MiB
    assert _rss_mb() - before < 64  # nothing committed yet
    assert cache.shape == (3, 8192, 16, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert big.dtype == torch.float32
    cache[:, 5] = 1.5
    assert float(cache[:, 5].float().sum()) == 1.5 * 3 * 16 * 64
    assert not cache[:, :5].any() and not cache[:, 6:100].any()
    block = big[1, 40000]
    assert not block.any()
    big[:, 1000:1100] = torch.nan  # written blocks become resident; the rest stays untouched
    assert torch.isnan(big[:, 1000:1100]).all() and not big[:, 1100:1200].any()
    assert _rss_mb() - before < 128


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The fraction of the tensor's own pages that are resident (mincore(2)). Unlike a VmRSS
    delta, nothing else the process allocates or frees meanwhile moves it: CI saw the heap give
    back 8 MB during a 64 MB preallocation, which a VmRSS delta reads as 56 MB committed."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.nbytes) // page) * page
    num_pages = (end - start) // page
    vec = (ctypes.c_ubyte * num_pages)()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / num_pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_kv_cache_is_not_advised_huge_pages():
    """A huge page would make a written 1 KiB block commit 2 MiB (numpy advises them for large
    arrays); the cache's mapping must not carry the advice ('hg'), and numpy's switch is left
    as it was for every other array."""
    import numpy as np

    switch = np._core.multiarray._set_madvise_hugepage
    before = switch(True)
    switch(before)
    cache = _lazy_zeros((3, 8192, 16, 64), dtype=torch.bfloat16, device=torch.device("cpu"))  # 48 MiB
    assert "hg" not in _vm_flags(cache.data_ptr() + cache.nbytes // 2)
    after = switch(before)
    assert after == before


def test_preallocated_kv_cache_is_resident_and_zero():
    """`kv_cache_preallocate=True` commits the whole cache at start-up (vLLM CPU's way): the
    resident set grows by its size before any block is written, and it still reads as zeros."""
    from types import SimpleNamespace

    from mmkit.models.interfaces import ModelCapabilities
    from mmkit.worker.kv_cache import allocate_kv_caches

    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                            device=torch.device("cpu"), capabilities=ModelCapabilities((None, None)))
    # 64 MiB a tensor: past glibc's largest dynamic mmap threshold (32 MiB), so calloc maps fresh
    # pages however much the suite has freed before; a smaller one can come from recycled heap
    # memory, which calloc memsets (correct zeros, only not lazy). Only the partial pages at
    # either end of a buffer may share a resident page.
    lazy = allocate_kv_caches(model, num_blocks=8192, block_size=16)  # 2 layers x (K, V) x 64 MiB
    assert all(_resident_fraction(c) < 0.01 for pair in lazy for c in pair)
    del lazy
    caches = allocate_kv_caches(model, num_blocks=8192, block_size=16, preallocate=True)
    assert all(_resident_fraction(c) == 1.0 for pair in caches for c in pair)
    assert len(caches) == 2 and all(not c.any() for pair in caches for c in pair)
    # every page is committed anyway, so the cache is advised huge pages (fewer TLB misses for
    # the decode attention's scattered blocks); a lazy cache is not (above)
    assert all("hg" in _vm_flags(c.data_ptr() + c.nbytes // 2) for pair in caches for c in pair)
    assert all("hg" not in _vm_flags(c.data_ptr() + c.nbytes // 2)
               for pair in allocate_kv_caches(model, num_blocks=8192, block_size=16) for c in pair)
    assert caches[0][0].shape == (2, 8192, 16, 64)


def test_kv_cache_preallocate_must_be_bool():
    import pytest

    from mmkit.config import EngineArgs

    with pytest.raises(TypeError, match="kv_cache_preallocate: got str; expected bool"):
        EngineArgs(model="x", kv_cache_preallocate="yes").create_engine_config()


def test_llm_with_preallocated_kv_cache_matches_hf(tiny_ckpt):
    """The engine path: `LLM(kv_cache_preallocate=True)` holds a resident, zeroed cache and
    generates transformers' greedy ids."""
    from mmkit import LLM, SamplingParams
    from conftest import hf_greedy, make_image

    llm = LLM(str(tiny_ckpt), dtype="float32", kv_cache_memory=8 << 20, kv_cache_preallocate=True)
    assert llm.llm_engine.config.cache.kv_cache_preallocate is True
    k = llm.llm_engine.model_runner.kv_caches[0][0]
    assert not k.any()
    image = make_image(3)
    ref = hf_greedy(str(tiny_ckpt), prompt="USER: <image>\nWhat is it? ASSISTANT:", images=[image],
                    max_new_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ref
