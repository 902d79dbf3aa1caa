"""benchmarks/gpu/check.sh --dry-run: every step of the GPU check on CPU (pip --dry-run offline,
the import check, `pytest -m cuda --collect-only`, the tiny shapes end to end on the flex
backend with the CUDA-graph buffers, the summary). The default suite runs it without the
test collection and with one shape; the whole dry run is `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), "--dry-run", "--out", str(out),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _steps(out: Path) -> dict:
    return {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}


def test_dry_run_one_shape(tmp_path):
    res = run_check(tmp_path, "--skip-tests", "--only-shape", "tiny-llava")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    steps = _steps(tmp_path)
    assert list(steps) == ["env", "install", "import", "e2e_llava", "summary"]
    assert all(s["rc"] == 0 and s["dry_run"] == 1 for s in steps.values())
    assert "Would install mmkit" in (tmp_path / "install.log").read_text()
    assert json.loads((tmp_path / "env.json").read_text())["cuda_available"] is False
    run = json.loads((tmp_path / "e2e_tiny-llava.json").read_text())
    mm = run["mmkit"]
    assert mm["attention_backend"] == "flex" and mm["cuda_graphs"] is True
    assert mm["decode_heavy"]["tokens"] == 3 * 4 and mm["decode_step"]["steps"] > 0
    assert run["transformers"]["best_batch"] in (1, 3)
    assert (tmp_path / "kernels_tiny-llava.txt").read_text().strip()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"]["tiny-llava"]["decode_heavy_vs_hf_best"] > 0
    assert not list(tmp_path.glob("ckpt_*"))  # the checkpoint is removed


def test_unknown_argument_is_refused(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), "--fast"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "check.sh: unknown argument --fast" in res.stderr


@pytest.mark.slow
def test_whole_dry_run(tmp_path):
    res = run_check(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    steps = _steps(tmp_path)
    assert list(steps) == ["env", "install", "import", "cuda_tests", "e2e_llava", "e2e_qwen", "summary"]
    listed = (tmp_path / "cuda_tests.log").read_text()
    assert "tests/gpu/test_flex_attention.py::test_flex_compiled_on_cuda_matches_reference" in listed
    assert "tests/gpu/test_cuda_graphs.py::test_graph_replay_equals_eager_on_cuda" in listed
    assert json.loads((tmp_path / "e2e_tiny-qwen2-vl.json").read_text())["mmkit"]["cuda_graphs"] is False
