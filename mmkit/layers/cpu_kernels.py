"""CPU kernels written in C, compiled at first use and called through ctypes.

Why C and not torch ops: decode attention over a paged cache in torch must first copy every
live K/V block of the batch into a dense tensor (`index_select`), then read it again in SDPA;
at 128 sequences that copy was a third of a decode step. The kernel in `csrc/` reads the
blocks where they are. In bfloat16, the decoder's elementwise work (residual add + RMSNorm,
rotary, SiLU * up) is 4-8 torch ops per step, each a pass over memory with bf16 <-> float
conversions; `csrc/elementwise_cpu.c` does each in one pass, rounding as transformers does.
Small kernels (KV writes, decode-sized elementwise work) run on the calling thread: under
OMP_WAIT_POLICY=PASSIVE every OpenMP parallel region wakes a sleeping worker, which costs
more than the work itself (measured: a 128x576 add takes 79 us with two threads, 9 us with one).
The kernels need no torch headers, so building them is one `cc` call (about a second)
instead of a C++ extension build (a minute); the shared object is cached under
`$MMKIT_CACHE_DIR` (default `~/.cache/mmkit`) keyed by the sources, the flags, the compiler
(path and version) and the CPU, since `-march=native` code must not run on another CPU.

When no compiler is found or the build fails, mmkit warns once and keeps the torch path (same
results, slower decode). `MMKIT_CPU_KERNELS=0` turns the kernels off (A/B measurements).

Environment switches (each part of the cache key):
- `MMKIT_REQUIRE_CPU_KERNELS=1`: a failed build raises instead of falling back (CI sets it,
  so a broken kernel fails the suite rather than skipping its tests).
- `MMKIT_KERNEL_GENERIC=1`: build for the baseline ISA (no `-march=native`), so the portable
  code paths run even on an AVX-512 machine (tests compare both).
- `MMKIT_KERNEL_NO_AVX512=1`: `-march=native` without AVX-512 (`-mno-avx512f`), so an AVX-512
  machine builds and runs what an AVX2-only CPU runs (the AVX2 panels and prefill tiles; CI's
  hosts have had AVX-512, and the tests run those paths this way).
- `MMKIT_KERNEL_CHECKS=1`: a bounds-checking build; the paged-attention and KV-write kernels
  validate block ids, context lengths and slots and raise `IndexError` (the tests use it).
A cache folder that cannot be written falls back to a per-user folder under the temp dir.

In the sources, `#pragma omp simd` on a loop says it must compile to vector code: gcc decides
per inlined copy and can leave one copy scalar with the results still right, so
tests/layers/test_kernel_vectorization.py cross-compiles for AVX2 and AVX-512 targets and fails
on any such loop gcc reports it could not vectorize.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from mmkit import envs

_SOURCE_DIR = Path(__file__).with_name("csrc")
# -fno-trapping-math: no kernel reads the FP exception flags, and without it gcc cannot
# if-convert a float select (exp_clamped's clamp) on CPUs without AVX-512's masked ops, so on
# AVX2 every loop calling exp_clamped (SiLU, the softmax numerators) ran scalar: SiLU-mul was
# 9% of a bf16 prefill-heavy run on Zen 3. It changes no result: rounding and operation order
# stay IEEE's (that would take -ffast-math's other parts, which stay off).
_BASE_FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library, or None once known unavailable


def kernels_enabled() -> bool:
    return envs.MMKIT_CPU_KERNELS


def build_flags() -> tuple[str, ...]:
    flags = list(_BASE_FLAGS)
    if not envs.MMKIT_KERNEL_GENERIC:
        flags.insert(1, "-march=native")
        if envs.MMKIT_KERNEL_NO_AVX512:
            flags.insert(2, "-mno-avx512f")  # turns off every AVX-512 subset with it
    if envs.MMKIT_KERNEL_CHECKS:
        flags.append("-DMMKIT_KERNEL_CHECKS")
    return tuple(flags)


def cache_dir() -> Path:
    root = envs.MMKIT_CACHE_DIR or Path.home() / ".cache" / "mmkit"
    return Path(root) / "kernels"


def _fallback_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"mmkit-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}.{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


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
    sources = sorted(_SOURCE_DIR.glob("*.c"))
    texts = [f.read_bytes() for f in sorted(_SOURCE_DIR.glob("*.[ch]"))]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = build_flags()
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), compiler.encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    name = f"mmkit_cpu-{key}.so"
    for folder in (cache_dir(), _fallback_cache_dir()):
        if (folder / name).exists():
            return folder / name
    # A read-only (or unusable) cache folder: build into a per-user temporary one instead.
    folder = cache_dir() if _writable_dir(cache_dir()) else _fallback_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    # Build beside the target and rename: concurrent processes never load a half-written file.
    partial = target.with_name(f"{target.stem}.{os.getpid()}.{threading.get_ident()}.part")
    proc = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(partial), "-lm"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


_I64, _PTR, _INT, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "mmkit_paged_decode_attention": ([_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                      _I64, _I64, _I64, _FLOAT, _INT, _INT], _INT),
    "mmkit_paged_rows_attention": ([_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                    _I64, _I64, _I64, _FLOAT, _INT, _INT], _INT),
    "mmkit_rms_norm_bf16": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT, _INT], None),
    "mmkit_rotary_bf16": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], None),
    "mmkit_silu_mul_bf16": ([_PTR, _PTR, _I64, _I64, _INT], None),
    # float32 twins (csrc/elementwise_f32_cpu.c, wrapped in fused_f32.py)
    "mmkit_rms_norm_f32": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT, _INT], None),
    "mmkit_rotary_f32": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], None),
    "mmkit_silu_mul_f32": ([_PTR, _PTR, _I64, _I64, _INT], None),
    "mmkit_argmax_rows": ([_PTR, _I64, _I64, _I64, _INT, _PTR, _INT], _I64),
    "mmkit_write_kv": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64], _INT),
    "mmkit_has_avx512": ([], _INT),
    "mmkit_dense_gemv_f32": ([_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT], None),
    "mmkit_panel_gemm": ([_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT], _INT),
    "mmkit_panel_gemm_available": ([], _INT),
    "mmkit_panel_gemm_silu_mul": ([_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT], _INT),
    "mmkit_panel_gemm_silu_mul_takes": ([_I64, _I64], _INT),
    "mmkit_panel_f32_halves": ([], _INT),
    "mmkit_quant_panel_gemm_available": ([], _INT),
    "mmkit_quant_panel_gemm": ([_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT, _PTR, _PTR, _I64, _PTR, _I64,
                                _INT], _INT),
    # the whole decoder stack of a decode step (csrc/decode_stack_cpu.c, wrapped in models/llama_decode_stack.py)
    "mmkit_decode_stack": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR], _INT),
    "mmkit_decode_stack_work_bytes": ([_I64, _I64, _I64, _I64, _I64, _I64, _INT], _I64),
    "mmkit_decode_stack_warm_offsets": ([_PTR, _PTR, _I64], _I64),
    "mmkit_apply_token_bitmask": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _INT, _INT], None),
}
_OUT_OF_BOUNDS = 2  # status of the bounds-checking build (MMKIT_KERNEL_CHECKS=1)


def _load() -> ctypes.CDLL:
    # torch is imported first (above), so the library's libgomp.so.1 resolves to the OpenMP
    # runtime torch already loaded: one thread pool, not two competing for the cores.
    lib = ctypes.CDLL(str(_build()))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled with MMKIT_CPU_KERNELS=0, or the build failed)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib = None
                if kernels_enabled():
                    try:
                        lib = _load()
                    except Exception as exc:  # noqa: BLE001 - any failure means: use torch
                        if envs.MMKIT_REQUIRE_CPU_KERNELS:
                            raise RuntimeError(f"mmkit: the CPU kernels failed to build or load ({exc}) and "
                                               "MMKIT_REQUIRE_CPU_KERNELS=1 forbids the torch fallback") from exc
                        warnings.warn(f"mmkit: the CPU kernels are unavailable ({exc}); "
                                      "the slower torch ops are used instead", RuntimeWarning, stacklevel=2)
                _state["lib"] = lib
    return _state["lib"]


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, float32/bfloat16, dense rows)."""
    return (q.is_cpu and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and k_cache.is_contiguous())


def _check_attention_status(status: int, num_blocks: int, max_blocks: int, block_size: int, tiles: str) -> None:
    """Raise for an attention kernel's nonzero status (csrc/paged_attention_cpu.c::run_rows)."""
    if status == _OUT_OF_BOUNDS:
        raise IndexError(f"mmkit: paged attention: a block id (of {num_blocks} blocks), a context length "
                         f"(at most {max_blocks} x {block_size}){tiles} is out of range")
    if status != 0:
        raise MemoryError("mmkit: the CPU attention kernel could not allocate its scratch buffers")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_ids: torch.Tensor, max_blocks: int, context_lens: torch.Tensor,
                           scale: float, context_starts: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention read in place from the paged cache; None when the kernel cannot run.

    q: [num_seqs, num_heads, head_dim] (rows may be strided, heads dense); caches:
    [kv_heads, num_blocks, block_size, head_dim]; block_ids: [num_seqs * max_blocks] int64;
    context_lens: [num_seqs] int64 (rows of the listed blocks, the new token included);
    context_starts: [num_seqs] int64, the first row attended (a sliding window), or None (0).
    Returns [num_seqs, num_heads, head_dim].
    """
    lib = library()
    if lib is None or not supports(q, k_cache) or not v_cache.is_contiguous():
        return None
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    block_ids = block_ids.contiguous()
    context_lens = context_lens.contiguous()
    starts_ptr = None
    if context_starts is not None:
        context_starts = context_starts.contiguous()
        starts_ptr = context_starts.data_ptr()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    status = lib.mmkit_paged_decode_attention(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_ids.data_ptr(), max_blocks, context_lens.data_ptr(), starts_ptr, num_seqs, num_heads, kv_heads,
                head_dim, num_blocks, block_size, scale, _DTYPES[q.dtype], torch.get_num_threads())
    _check_attention_status(status, num_blocks, max_blocks, block_size, "")
    return out


def paged_rows_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_ids: torch.Tensor, max_blocks: int, context_lens: torch.Tensor,
                         tiles: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`paged_decode_attention` (global layers) over rows grouped in tiles; None when the kernel
    cannot run. tiles: [num_tiles + 1] int64, tile i = rows [tiles[i], tiles[i + 1]), ending at
    num_seqs. A tile of several rows must be consecutive tokens of one sequence (the same block
    table, non-decreasing context lengths): its context is read from the cache once for all of
    them, which is what makes prefill chunks cheap here."""
    lib = library()
    if lib is None or not supports(q, k_cache) or not v_cache.is_contiguous():
        return None
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    block_ids, context_lens, tiles = block_ids.contiguous(), context_lens.contiguous(), tiles.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    status = lib.mmkit_paged_rows_attention(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                v_cache.data_ptr(), block_ids.data_ptr(), max_blocks, context_lens.data_ptr(), tiles.data_ptr(),
                tiles.numel() - 1, num_seqs, num_heads, kv_heads, head_dim, num_blocks, block_size, scale,
                _DTYPES[q.dtype], torch.get_num_threads())
    _check_attention_status(status, num_blocks, max_blocks, block_size, " or a row tile")
    return out


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copy rows k, v ([num_tokens, kv_heads, head_dim], heads dense) into the caches
    ([kv_heads, num_blocks, block_size, head_dim]) at `slot_mapping`. Any dtype: a byte copy,
    bit-identical to index_copy_. False when the kernel cannot run (nothing written)."""
    lib = library()
    if (lib is None or not k.is_cpu or k.dim() != 3 or k.dtype != k_cache.dtype or v.dtype != k.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slot_mapping.dtype != torch.long
            or k.stride(2) != 1 or v.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]):
        return False
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    slot_mapping = slot_mapping.contiguous()
    status = lib.mmkit_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                                v.stride(0), slot_mapping.data_ptr(), k.shape[0], kv_heads, num_blocks * block_size,
                                head_dim, k.element_size())
    if status == _OUT_OF_BOUNDS:
        raise IndexError(f"mmkit: KV write: a slot is out of range [0, {num_blocks * block_size})")
    return True


def has_avx512() -> bool:
    """Whether the loaded build contains the AVX-512 code paths."""
    lib = library()
    return bool(lib is not None and lib.mmkit_has_avx512())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """First index of each row's maximum ([rows, vocab] float32 or bf16, rows may be strided),
    as int64 [rows]; None when the kernel cannot run or a row holds a NaN (torch decides those)."""
    lib = library()
    if lib is None or not logits.is_cpu or logits.dim() != 2 or logits.dtype not in _DTYPES \
            or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.long)
    nan_rows = lib.mmkit_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                     _DTYPES[logits.dtype], out.data_ptr(), torch.get_num_threads())
    return out if nan_rows == 0 else None


_MASK_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> bool:
    """Structured outputs: set logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in
    `indices`. logits: [rows, vocab] float32/bfloat16/float16 (rows may be strided); bitmask:
    [>= rows, ceil(vocab / 32)] int32, xgrammar's layout. False when the kernel cannot run
    (logits untouched)."""
    lib = library()
    if (lib is None or logits.device.type != "cpu" or logits.dtype not in _MASK_DTYPES or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1
            or bitmask.shape[1] * 32 < logits.shape[1]):
        return False
    rows = torch.tensor(indices, dtype=torch.long)
    lib.mmkit_apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                  rows.data_ptr(), len(indices), logits.shape[1], _MASK_DTYPES[logits.dtype],
                                  torch.get_num_threads())
    return True


# Below this many weight bytes one thread runs the GEMV: waking the sleeping OpenMP worker
# (OMP_WAIT_POLICY=PASSIVE) costs more than reading a small matrix from cache.
_GEMV_PARALLEL_BYTES = 1 << 18


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T + bias` for a few float32 rows: x [M, K] (rows may be strided), weight
    [N, K] row-major, on CPU; returns [M, N] float32. None when the kernel cannot run. Meant
    for decode at small batch, where the weight is read once from memory (csrc/dense_gemv_cpu.c)."""
    lib = library()
    if (lib is None or not x.is_cpu or x.dim() != 2 or x.dtype != torch.float32 or weight.dtype != x.dtype
            or x.stride(1) != 1 or not weight.is_contiguous() or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    threads = torch.get_num_threads() if weight.numel() * weight.element_size() >= _GEMV_PARALLEL_BYTES else 1
    lib.mmkit_dense_gemv_f32(out.data_ptr(), x.data_ptr(), x.stride(0), m, k, n, weight.data_ptr(),
                             bias.data_ptr() if bias is not None else None, threads)
    return out


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    # `is_cpu` rather than `device.type`: called ~200 times per decode step (no device object)
    for t in tensors:
        if not (t.is_cpu and t.dtype is torch.bfloat16 and t.is_contiguous()):
            return False
    return True


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """`weight * bf16(rms_normalize(h))` for h = x, or for h = x + residual, which is then stored
    into x (in place: x becomes the new residual stream; `residual` is only read).
    x, residual: [num_tokens, hidden] bf16. None when the kernel cannot run (x untouched)."""
    lib = library()
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if lib is None or x.dim() != 2 or not _bf16_rows(*tensors):
        return None
    out = torch.empty_like(x)
    lib.mmkit_rms_norm_bf16(out.data_ptr(), x.data_ptr(), (residual if residual is not None else x).data_ptr(),
                            weight.data_ptr(), x.shape[0], x.shape[1], eps, residual is not None,
                            torch.get_num_threads())
    return out


def rotary_bf16_(x: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                 signed_sin: torch.Tensor) -> bool:
    """Rotate the first `num_heads` heads of each row of x ([num_tokens, heads, head_dim] bf16,
    contiguous) in place, with float32 tables [max_positions, head_dim]. False when the kernel
    cannot run (x untouched)."""
    lib = library()
    if (lib is None or x.dim() != 3 or not _bf16_rows(x) or positions.dtype != torch.long
            or cos.dtype != torch.float32 or not (cos.is_contiguous() and signed_sin.is_contiguous())):
        return False
    positions = positions.contiguous()
    lib.mmkit_rotary_bf16(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                          x.shape[0], x.stride(0), num_heads, x.shape[2], torch.get_num_threads())
    return True


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`bf16(silu(gate)) * up` for gate_up = [gate | up] ([num_tokens, 2 * inter] bf16)."""
    lib = library()
    if lib is None or gate_up.dim() != 2 or not _bf16_rows(gate_up):
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    lib.mmkit_silu_mul_bf16(out.data_ptr(), gate_up.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
    return out
