"""CPU kernels written in C, compiled at first use and called through ctypes.

Why C and not torch ops: decode attention over a paged cache in torch must first copy every
live K/V block of the batch into a dense tensor (`index_select`), then read it again in SDPA;
at 128 sequences that copy was a third of a decode step. The kernel in `csrc/` reads the
blocks where they are. It needs no torch headers, so building it is one `cc` call (about a
second) instead of a C++ extension build (a minute); the shared object is cached under
`$MMKIT_CACHE_DIR` (default `~/.cache/mmkit`) keyed by the source, the flags, the compiler and
the CPU, since `-march=native` code must not run on another CPU.

When no compiler is found or the build fails, mmkit warns once and keeps the torch path (same
results, slower decode). `MMKIT_CPU_KERNELS=0` turns the kernels off (A/B measurements).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the ctypes function, or None once known unavailable


def kernels_enabled() -> bool:
    return os.environ.get("MMKIT_CPU_KERNELS", "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("MMKIT_CACHE_DIR") or Path.home() / ".cache" / "mmkit"
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """What `-march=native` depends on: the architecture and the CPU's feature flags."""
    text = ""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        pass
    lines = sorted({ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features"))})
    return platform.machine() + "\n" + "\n".join(lines)


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    target = cache_dir() / f"paged_attention_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    partial = target.with_name(f"{target.stem}.{os.getpid()}.{threading.get_ident()}.part")
    proc = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(partial), "-lm"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


def _load():
    # torch is imported first (above), so the kernel's libgomp.so.1 resolves to the OpenMP
    # runtime torch already loaded: one thread pool, not two competing for the cores.
    lib = ctypes.CDLL(str(_build()))
    fn = lib.mmkit_paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                   ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def decode_kernel():
    """The compiled decode-attention function, or None (disabled, or the build failed)."""
    if "fn" not in _state:
        with _lock:
            if "fn" not in _state:
                fn = None
                if kernels_enabled():
                    try:
                        fn = _load()
                    except Exception as exc:  # noqa: BLE001 - any failure means: use torch
                        warnings.warn(f"mmkit: the CPU attention kernel is unavailable ({exc}); "
                                      "decoding uses the slower torch path", RuntimeWarning, stacklevel=2)
                _state["fn"] = fn
    return _state["fn"]


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, float32/bfloat16, dense rows)."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and k_cache.is_contiguous())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_ids: torch.Tensor, max_blocks: int, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor | None:
    """Decode attention read in place from the paged cache; None when the kernel cannot run.

    q: [num_seqs, num_heads, head_dim] (rows may be strided, heads dense); caches:
    [kv_heads, num_blocks, block_size, head_dim]; block_ids: [num_seqs * max_blocks] int64;
    context_lens: [num_seqs] int64. Returns [num_seqs, num_heads, head_dim].
    """
    fn = decode_kernel()
    if fn is None or not supports(q, k_cache) or not v_cache.is_contiguous():
        return None
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    block_ids = block_ids.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    status = fn(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_ids.data_ptr(), max_blocks, context_lens.data_ptr(), num_seqs, num_heads, kv_heads,
                head_dim, num_blocks, block_size, scale, _DTYPES[q.dtype], torch.get_num_threads())
    if status != 0:
        raise MemoryError("mmkit: the CPU attention kernel could not allocate its scratch buffers")
    return out
