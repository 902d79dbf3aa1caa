"""How the C kernels are built: strict mode for CI, the generic (non-AVX-512) build, the
bounds-checking build the suite runs with, and a read-only cache folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mmkit.layers import cpu_kernels
from mmkit.layers.attention import AttentionMetadata, build_decode_metadata, kv_cache_shape

needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: torch fallback only")


@pytest.fixture()
def fresh_library(monkeypatch):
    """Forget the loaded library for the test (and restore it after)."""
    saved = dict(cpu_kernels._state)
    cpu_kernels._state.clear()
    yield
    cpu_kernels._state.clear()
    cpu_kernels._state.update(saved)


def test_required_kernels_that_fail_to_build_raise(tmp_path, monkeypatch, fresh_library):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("MMKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MMKIT_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(RuntimeError, match="MMKIT_REQUIRE_CPU_KERNELS=1 forbids the torch fallback"):
        cpu_kernels.library()


@needs_kernels
def test_unwritable_cache_folder_falls_back_to_a_temporary_one(tmp_path, monkeypatch, fresh_library):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")  # unwritable even for root
    monkeypatch.setenv("MMKIT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = cpu_kernels._build()
    assert path.exists() and path.parent == cpu_kernels._fallback_cache_dir()
    assert str(path).startswith(str(tmp_path / "tmp"))
    assert cpu_kernels.library() is not None


def _decode_problem(lens, heads, kv_heads, dim, block_size, num_blocks):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, dim), generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    tables = [list(range(i * 4, i * 4 + -(-n // block_size))) for i, n in enumerate(lens)]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long))
    build_decode_metadata(meta, tables, list(lens), block_size, torch.device("cpu"))
    return torch.randn(len(lens), heads, dim, generator=gen), k_cache, v_cache, meta


@needs_kernels
def test_bounds_checking_build_rejects_bad_block_ids_and_slots():
    assert os.environ.get("MMKIT_KERNEL_CHECKS") == "1"  # tests/conftest.py: the suite runs checked
    assert "-DMMKIT_KERNEL_CHECKS" in cpu_kernels.build_flags()
    q, k_cache, v_cache, meta = _decode_problem([5, 9], 4, 2, 16, 4, num_blocks=8)
    ok = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_ids, meta.decode_max_blocks,
                                            meta.decode_context_lens, 0.25)
    assert ok is not None and torch.isfinite(ok).all()
    bad_ids = meta.decode_block_ids.clone()
    bad_ids[0] = 8  # one past the last block
    with pytest.raises(IndexError, match="block id"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, bad_ids, meta.decode_max_blocks,
                                           meta.decode_context_lens, 0.25)
    too_long = meta.decode_context_lens.clone()
    too_long[1] = meta.decode_max_blocks * 4 + 1
    with pytest.raises(IndexError, match="context length"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_ids, meta.decode_max_blocks,
                                           too_long, 0.25)
    k = torch.randn(3, 2, 16)
    before = k_cache.clone()
    with pytest.raises(IndexError, match="slot"):
        cpu_kernels.write_kv(k_cache, v_cache, k, k.clone(), torch.tensor([0, 32, 1]))
    assert torch.equal(k_cache, before)  # nothing written


_GENERIC_CHECK = r"""
import torch
from mmkit.layers import cpu_kernels
from mmkit.layers.attention import AttentionMetadata, build_decode_metadata, decode_attention_torch, kv_cache_shape
assert "-march=native" not in cpu_kernels.build_flags()
assert cpu_kernels.library() is not None and not cpu_kernels.has_avx512()
gen = torch.Generator().manual_seed(0)
for dtype, atol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
    for dim in (64, 128, 16):  # 64/128 take the AVX-512 path in a native build
        lens = [1, 16, 17, 300]
        tables, at = [], 0
        for n in lens:
            tables.append(list(range(at, at + -(-n // 16)))); at += -(-n // 16)
        k = torch.randn(kv_cache_shape(at, 16, 2, dim), generator=gen).to(dtype)
        v = torch.randn(k.shape, generator=gen).to(dtype)
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long))
        build_decode_metadata(meta, tables, lens, 16, torch.device("cpu"))
        q = torch.randn(len(lens), 4, dim, generator=gen).to(dtype)
        out = cpu_kernels.paged_decode_attention(q, k, v, meta.decode_block_ids, meta.decode_max_blocks,
                                                 meta.decode_context_lens, dim ** -0.5)
        ref = decode_attention_torch(q, k, v, meta, dim ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)
logits = torch.randn(5, 3000, generator=gen)
assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(-1))
print("generic ok")
"""


@needs_kernels
def test_generic_build_runs_the_portable_paths(tmp_path):
    env = dict(os.environ, MMKIT_KERNEL_GENERIC="1", MMKIT_CACHE_DIR=str(tmp_path), MMKIT_REQUIRE_CPU_KERNELS="1")
    proc = subprocess.run([sys.executable, "-c", _GENERIC_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generic ok" in proc.stdout
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in cpu_flags:
        assert cpu_kernels.has_avx512()  # the native build in this process takes the AVX-512 paths


@needs_kernels
def test_avx2_build_runs_the_avx2_paths(tmp_path):
    """The AVX2 panels, prefill tiles (csrc/paged_tile_avx2.h) and decode items
    (csrc/paged_item_avx2.h) on any AVX2 CPU, AVX-512 ones included: built with
    MMKIT_KERNEL_NO_AVX512=1, the same tile, decode and panel tests run against their references
    (rows bit-identical whatever their tile, F.linear, the torch decode path). On a CPU without
    AVX-512 the native build is that build already, and the suite runs those tests on it."""
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in cpu_flags or " fma" not in cpu_flags:
        pytest.skip("needs an AVX2 + FMA CPU")
    env = dict(os.environ, MMKIT_KERNEL_NO_AVX512="1", MMKIT_CACHE_DIR=str(tmp_path), MMKIT_REQUIRE_CPU_KERNELS="1")
    check = ("from mmkit.layers import cpu_kernels, linear_panels; "
             "assert '-mno-avx512f' in cpu_kernels.build_flags(); "
             "assert not cpu_kernels.has_avx512() and linear_panels.available(); print('avx2 build')")
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "avx2 build" in proc.stdout, proc.stderr[-3000:]
    if not cpu_kernels.has_avx512():
        # This process's native build already is the AVX2 build (no AVX-512 to turn off), and the
        # suite runs these tests on it directly: running them again here would add ~40 s, no paths.
        return
    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests / "test_cpu_kernels.py"), str(tests / "test_linear_kernels.py"),
                           "-k", "tile or sdpa or panel or decode_kernel"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-1500:]
