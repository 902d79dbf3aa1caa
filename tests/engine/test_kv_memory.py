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
