"""Every `#pragma omp simd` loop in the C kernels compiles to vector code, in every inlined
copy, for the two x86 targets the kernels are tuned for: AVX2 + FMA (`-march=haswell`: AMD
Zen 2/3 and Intel before Ice Lake run these paths) and AVX-512 with BF16 (`-march=sapphirerapids`).

Why a test: gcc decides per inlined copy. In round 4l the softmax loops of the shared helper
vectorized where one function inlined them and stayed scalar ("control flow in loop") where the
AVX2 prefill tile did, and the results were right, so nothing failed; about 45% of that tile's
time went to the scalar copy until a profile found it (benchmarks/HISTORY.md, round 4n). The
pragma is the source's statement that a loop must be SIMD; gcc's own vectorizer remarks
(`-fopt-info-vec-all`) say where it is not. Cross-compiling needs no such CPU: only gcc."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mmkit.layers import cpu_kernels

TARGETS = ("haswell", "sapphirerapids")
GCC = shutil.which("gcc")

pytestmark = pytest.mark.skipif(GCC is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="checks gcc's x86 vectorizer")

_MISSED = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+):\d+: missed: (?P<what>.*)$")


def simd_loops(text: str) -> list[tuple[int, int]]:
    """(first, last) source lines of each loop under `#pragma omp simd`: the pragma through
    the end of the loop's statement (its braces, or its one line up to the `;`)."""
    lines = text.splitlines()
    loops = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("#pragma omp simd"):
            continue
        j = i + 1
        while not lines[j].lstrip().startswith("for"):
            j += 1
        depth, opened = 0, False
        while True:
            depth += lines[j].count("{") - lines[j].count("}")
            opened = opened or "{" in lines[j]
            if (opened and depth <= 0) or (not opened and lines[j].rstrip().endswith(";")):
                break
            j += 1
        loops.append((i + 1, j + 1))
    return loops


def scalar_simd_loops(sources: list[Path], flags: list[str], out_dir: Path) -> list[str]:
    """Compiles `sources` into one shared object with `flags` and returns, for each remark of
    a `#pragma omp simd` loop that gcc could not vectorize, "file:line: reason"."""
    remarks = out_dir / "remarks.txt"
    proc = subprocess.run([GCC, *flags, *map(str, sources), "-o", str(out_dir / "k.so"), "-lm",
                           f"-fopt-info-vec-all={remarks}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    folders = {s.parent for s in sources}
    loops = {f.name: simd_loops(f.read_text()) for folder in folders for f in folder.glob("*.[ch]")}
    found, lines = [], remarks.read_text().splitlines()
    for i, line in enumerate(lines):
        m = _MISSED.match(line)
        if not m or m.group("what") != "couldn't vectorize loop":
            continue
        name, n = Path(m.group("path")).name, int(m.group("line"))
        if any(a <= n <= b for a, b in loops.get(name, [])):
            reason = lines[i + 1].split("missed: ", 1)[-1] if i + 1 < len(lines) else ""
            found.append(f"{name}:{n}: {reason}")
    return sorted(set(found))


def _sources_with_simd_loops(folder: Path) -> list[Path]:
    """The .c files holding an `omp simd` loop, themselves or in a header they include: only
    those are compiled (a shared object may leave the others' symbols undefined), which halves
    the check's time."""
    marked = {f.name for f in folder.glob("*.h") if "#pragma omp simd" in f.read_text()}
    return [f for f in sorted(folder.glob("*.c"))
            if "#pragma omp simd" in (text := f.read_text()) or any(f'#include "{h}"' in text for h in marked)]


def _flags(march: str, *, trapping_math: bool = False) -> list[str]:
    flags = [f for f in cpu_kernels._BASE_FLAGS if not (trapping_math and f == "-fno-trapping-math")]
    return [flags[0], f"-march={march}", *flags[1:]]


def _accepts(march: str) -> bool:
    proc = subprocess.run([GCC, f"-march={march}", "-x", "c", "-c", "-o", "/dev/null", "-"], input="int x;\n",
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


def test_simd_loop_ranges_cover_braced_and_one_line_bodies():
    text = ("void f(void) {\n#pragma omp simd reduction(+ : s)\n    for (i = 0; i < n; i++) {\n"
            "        s += a[i];\n    }\n#pragma omp simd\n    for (i = 0; i < n; i++)\n"
            "        b[i] = a[i];\n    c = 1;\n}\n")
    assert simd_loops(text) == [(2, 5), (6, 8)]


@pytest.fixture(scope="module")
def scalar_by_target(tmp_path_factory) -> dict[str, list[str] | None]:
    """The kernels built for each target at once (two gcc processes: the suite's two cores);
    None for a target this gcc does not know."""
    sources = _sources_with_simd_loops(cpu_kernels._SOURCE_DIR)

    def check(march: str) -> list[str] | None:
        if not _accepts(march):
            return None
        return scalar_simd_loops(sources, _flags(march), tmp_path_factory.mktemp(march))

    with ThreadPoolExecutor(len(TARGETS)) as pool:
        return dict(zip(TARGETS, pool.map(check, TARGETS)))


@pytest.mark.parametrize("march", TARGETS)
def test_every_omp_simd_loop_vectorizes(march, scalar_by_target):
    scalar = scalar_by_target[march]
    if scalar is None:
        pytest.skip(f"this gcc does not know -march={march}")
    assert not scalar, (f"-march={march}: these `#pragma omp simd` loops stay scalar in at least one inlined "
                        f"copy (gcc's -fopt-info-vec-all remarks):\n" + "\n".join(scalar))


def test_the_check_finds_a_loop_left_scalar(tmp_path):
    """The failure it guards against, rebuilt: the softmax numerators' exp (bf16.h's
    exp_clamped) under `omp simd`. Without -fno-trapping-math gcc cannot if-convert the clamp
    on AVX2 and keeps the loop scalar, and the check must say so; with the flag (as the
    kernels are built) it vectorizes."""
    src = tmp_path / "softmax.c"
    src.write_text(f'#include <stdint.h>\n#include "{cpu_kernels._SOURCE_DIR / "bf16.h"}"\n'
                   "void numerators(float *s, int64_t n, float mx) {\n"
                   "#pragma omp simd\n"
                   "    for (int64_t t = 0; t < n; t++) s[t] = exp_clamped(s[t] - mx);\n}\n")
    (tmp_path / "trapping").mkdir()
    (tmp_path / "kernels").mkdir()
    scalar = scalar_simd_loops([src], _flags("haswell", trapping_math=True), tmp_path / "trapping")
    assert scalar and scalar[0].startswith("softmax.c:5: ") and "control flow" in scalar[0]
    assert scalar_simd_loops([src], _flags("haswell"), tmp_path / "kernels") == []
