"""Every Python block of README.md runs as written from the repository root, so the README
cannot drift from the code. A block that needs what it does not create (a real checkpoint, a
running server) says so on its FIRST line, `# needs: ...`, and is skipped by that rule only.

Each block runs alone in a fresh `python` subprocess (cwd: the repo root, torch threads set,
OpenMP not spinning), with a timeout; it must exit 0 and leave the clone's `git status`
unchanged (what it writes goes to a temp folder or is git-ignored).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
NEEDS = "# needs:"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
# Blocks that start Ray (seconds of process start-up whatever the work) run with the slow tests.
_SLOW = ("import ray",)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def _params() -> list:
    params = []
    for line, code in python_blocks(README.read_text(encoding="utf-8")):
        marks = [pytest.mark.slow] if any(s in code for s in _SLOW) else []
        params.append(pytest.param(code, id=f"README.md:{line}", marks=marks))
    return params


def _untracked() -> set[str] | None:
    """Files in the clone that git neither tracks nor ignores (None outside a git checkout)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("?? ")}


def test_the_readme_has_python_blocks_and_the_needs_rule_is_first_line_only():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 8
    for line, code in blocks:
        # `# needs:` anywhere but the first line would not skip the block: a likely mistake.
        assert NEEDS not in code.split("\n", 1)[-1] or code.startswith(NEEDS), f"README.md:{line}"


@pytest.fixture
def short_tmp():
    # A short path: the blocks' temp files go here (Ray's socket paths must stay under 108 bytes).
    path = tempfile.mkdtemp(prefix="readme-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("code", _params())
def test_readme_block_runs(code, short_tmp):
    first = code.lstrip("\n").split("\n", 1)[0]
    if first.startswith(NEEDS):
        pytest.skip(first)
    threads = os.environ.get("MMKIT_TEST_THREADS", "2")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": threads,
           "MKL_NUM_THREADS": threads, "MPLBACKEND": "Agg", "TMPDIR": short_tmp, "PYTHONUNBUFFERED": "1"}
    before = _untracked()
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the block ran past 600 s:\n{exc.stdout}\n{exc.stderr}")
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-6000:]}"
    if before is not None:
        new = _untracked() - before
        assert not new, f"the block left files in the clone that .gitignore does not cover: {sorted(new)}"


def test_gitignore_covers_what_the_readme_commands_write():
    """`--output X` of the README's commands (and X's summary beside it) are git-ignored."""
    text = README.read_text(encoding="utf-8")
    outputs = set(re.findall(r"^\s+mmkit eval .*?--output (\S+)", text, re.M))
    assert outputs, "the README shows mmkit eval --output"
    written = sorted(outputs | {str(Path(o).with_name(Path(o).stem + ".summary.json")) for o in outputs})
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == written, out.stdout
