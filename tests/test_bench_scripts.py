"""Smoke runs of the round-2 benchmark scripts on a 1-layer benchmark LLaVA (slow: they
build the 49152-token benchmark checkpoint and run both systems)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script, *args):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--num-layers", "1",
                           "--threads", "1", *args], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_scaling_writes_both_plots(tmp_path):
    res = run("scaling.py", "--min-requests", "2", "--max-requests", "4", "--rates", "4",
              "--load-requests", "2", "--hf-batch-size", "2", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("throughput_vs_requests.png", "latency_vs_rate.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["requests"] for r in data["throughput"]] == [2, 4]
    assert all(r["mmkit_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in data["throughput"])
    assert data["latency"][0]["requests"] == 2


@pytest.mark.slow
def test_throughput_decode_heavy_rss_and_async_ab(tmp_path):
    out = tmp_path / "t.json"
    res = run("throughput.py", "--workload", "decode-heavy", "--num-requests", "3", "--repeats", "1",
              "--hf-batch-sizes", "all", "--rss", "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["parity"]["identical_requests"] >= 0 and set(data["rss_alone"]) == {"mmkit", "hf"}
    assert all(r["peak_rss_mb"] > r["rss_after_imports_mb"] > 0 for r in data["rss_alone"].values())
    assert data["kv_bytes_per_token"] == 2 * 1 * 3 * 64 * 2  # 1 layer, 3 KV heads, head_dim 64, bf16
    res = run("throughput.py", "--workload", "decode-heavy", "--num-requests", "2", "--repeats", "1",
              "--large-images", "--ab-async", "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["prefetched"] > 0 and len(data["throughput_ratio_per_repeat"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("system", ["mmkit", "hf"])
def test_load_rss_reports_the_loading_peak(system, tiny_ckpt, tmp_path):
    out = tmp_path / "rss.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_rss.py"), "--system", system,
                          "--model", str(tiny_ckpt), "--threads", "1", "--json", str(out)],
                         env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["system"] == system and data["dtype"] == "bfloat16"
    assert data["peak_rss_mb"] >= data["rss_after_load_mb"] > data["rss_after_imports_mb"] > 0
    assert "peak while loading" in res.stdout


@pytest.mark.slow
def test_step_split_accounts_for_every_step(tmp_path):
    out = tmp_path / "s.json"
    res = run("step_split.py", "--num-requests", "3", "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    prompt = sum(s["tokens"] for s in data["steps"] if s["tokens"] != s["seqs"])
    decoded = sum(s["tokens"] for s in data["steps"] if s["tokens"] == s["seqs"])
    assert prompt > 3 * 36 and decoded > 0  # 3 prompts of 36 image tokens and text, then decodes
    assert "decode-only steps" in res.stdout and "steps with prefill" in res.stdout
