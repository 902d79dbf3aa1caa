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


def _gemm_floor():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gemm_floor

    return gemm_floor


def test_gemm_floor_schedule_covers_every_row_and_logit():
    gemm_floor = _gemm_floor()
    prompts, outs = [3, 5, 2], [1, 3, 2]
    steps = gemm_floor.schedule(prompts, outs, chunk=4)
    # prefill: 10 tokens in chunks of 4, each prompt's last token in the chunk it ends in
    assert [tuple(s) for s in steps] == [(4, 1, True), (4, 1, True), (2, 1, True), (2, 2, False), (1, 1, False)]
    assert sum(s.logit_rows for s in steps) == sum(outs)  # one LM-head row per generated token
    assert sum(s.rows for s in steps) == sum(prompts) + sum(outs) - len(outs)  # the last token is never fed
    with pytest.raises(ValueError, match="positive"):
        gemm_floor.schedule([3, 0], [1, 1], chunk=4)


def test_gemm_floor_counts_the_benchmark_decoders_flops():
    from transformers import LlamaConfig

    gemm_floor = _gemm_floor()
    # the SmolLM2-135M shape of bench_model.py: fused qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536
    text = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                       num_hidden_layers=30, vocab_size=49152)
    shapes = gemm_floor.Shapes.of_text_config(text)
    assert shapes.layer == ((960, 576), (576, 576), (3072, 576), (576, 1536))
    assert shapes.token_flops() == 212_336_640 and shapes.logit_flops() == 56_623_104
    assert shapes.kv_width == 2 * 3 * 64  # K and V of 3 KV heads of 64


def test_gemm_floor_counts_the_kv_reads_of_decode_steps_and_prompts():
    from transformers import LlamaConfig

    gemm_floor = _gemm_floor()
    text = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                       num_hidden_layers=3, vocab_size=32)
    shapes = gemm_floor.Shapes.of_text_config(text)  # kv_width = 2 * 1 * 4 = 8 elements a token a layer
    # a 5-token prompt with 3 outputs: the prefill reads 5 rows, decode steps 1 and 2 read 6 and 7;
    # a 2-token prompt with 1 output has no decode step
    rows = 5 + 6 + 7 + 2
    assert gemm_floor.kv_read_bytes([5, 2], [3, 1], shapes, elem_bytes=2) == rows * 3 * 8 * 2


def test_gemm_floor_replays_a_tiny_workload(tiny_ckpt):
    import torch
    from transformers import AutoConfig

    from mmkit.layers import linear_panels

    gemm_floor = _gemm_floor()
    from peer_worker import workload

    spec = {"model": str(tiny_ckpt), "dtype": "float32", "threads": torch.get_num_threads(), "num_requests": 3,
            "min_prompt": 4, "max_prompt": 6, "seed": 0}
    kernels = ["F.linear"] + (["panels"] if linear_panels.available() else [])
    res = gemm_floor.measure(spec, kernels, chunk=16)
    reqs = workload(spec, seed=0)
    vision = AutoConfig.from_pretrained(tiny_ckpt).vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    assert res["output_tokens"] == sum(r.max_tokens for r in reqs)
    assert res["prompt_tokens"] == sum(1 + image_tokens + len(r.text_ids) for r in reqs)  # <s>, image, text
    for name in kernels:
        k = res["kernels"][name]
        assert k["seconds"] > 0 and k["bound_tok_s"] >= k["tok_s"] > 0
    with pytest.raises(ValueError, match="expected one of"):
        gemm_floor.measure(spec, ["mkl"])


def test_step_time_prints_a_row_per_context():
    """benchmarks/step_time.py on a tiny configuration (no model: scheduler, block manager and
    decode metadata alone)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--batch", "4",
                          "--contexts", "32,64", "--steps", "3", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    rows = [line.split("|") for line in lines if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [32, 64]
    assert all(float(r[1]) > 0 and float(r[2]) >= 0 for r in rows)


@pytest.mark.slow
def test_preprocess_times_the_three_modes_with_identical_ids(tmp_path):
    out = tmp_path / "p.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "preprocess.py"), "--num-requests", "3",
                          "--repeats", "1", "--threads", "1", "--workers", "1", "--max-pixels", "200704",
                          "--max-tokens", "2", "--micro", "--json", str(out)],
                         env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["median_seconds"]) == {"serial", "threads", "processes"} and data["identical_greedy_ids"]
    assert data["prefetch"]["processes"]["prefetched"] == 3 + 4 and data["prefetch"]["processes"]["inline"] == 0
    assert 0 < data["serial_processor_share"][0] < 1 and not data["cpu"].startswith("unknown")
    assert set(data["micro"]["ms_per_image"]) == {"serial", "threads_1", "threads_2", "processes_2"}

def test_peers_qwen2_vl_2b_shape_and_preprocessing_heavy_workload():
    """peers.py's 2B-class shape at a one-layer, one-block cut (no vLLM): Qwen2-VL-2B's
    dimensions in the checkpoint both engines load, image token counts equal to what the HF
    processor makes of the workload's images, and the preprocessing-heavy workload's lazily
    opened 1024x768 JPEGs."""
    import torch
    from PIL import JpegImagePlugin
    from transformers import AutoConfig, AutoProcessor

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers
    from gemm_floor import checkpoint_shapes, workload_lengths
    from peer_worker import inputs_of, workload

    torch.set_num_threads(1)
    spec = peers.workload_spec("decode-heavy", "float32", shape="qwen2-vl-2b", num_layers=1, vision_depth=1,
                               num_requests=3)
    cfg = AutoConfig.from_pretrained(spec["model"])
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.intermediate_size,
            text.vocab_size, text.num_hidden_layers) == (1536, 12, 2, 8960, 151936, 1)
    assert (vision.embed_dim, vision.num_heads, vision.patch_size, vision.depth) == (1280, 16, 14, 1)
    assert spec["num_requests"] == 3 and spec["num_layers"] == 1
    shapes, fixed_tokens = checkpoint_shapes(spec["model"])
    assert fixed_tokens is None and shapes.layer == ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
    processor = AutoProcessor.from_pretrained(spec["model"])
    ids = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert spec["prompt_prefix"] == ids
    photos = peers.workload_spec("preprocessing-heavy", "float32", shape="qwen2-vl-2b", num_layers=1,
                                 vision_depth=1, num_requests=2)
    for s in (spec, photos):
        reqs = inputs_of(workload(s, seed=0), s)
        assert all(r["prompt_token_ids"][:3] == ids and min(r["prompt_token_ids"][3:]) >= s["first_text_id"]
                   for r in reqs)
        grid = processor.image_processor(images=[reqs[0]["multi_modal_data"]["image"]], return_tensors="pt")
        assert int(grid["image_grid_thw"][0].prod()) // 4 == s["image_tokens"]
        prompts, _ = workload_lengths(s, s["image_tokens"])
        assert prompts[0] == 2 + s["image_tokens"] + len(reqs[0]["prompt_token_ids"]) - 3
    assert (spec["image_tokens"], photos["image_tokens"]) == (4, 999)  # 56x56 and 1036x756 px after resizing
    image = inputs_of(workload(photos, seed=0), photos)[0]["multi_modal_data"]["image"]
    assert isinstance(image, JpegImagePlugin.JpegImageFile) and image.size == peers.PHOTO_SIZE
    with pytest.raises(ValueError, match=r"shape: got 'qwen2-vl-7b'; expected one of \('toy', 'qwen2-vl-2b'\)"):
        peers.workload_spec("decode-heavy", "float32", shape="qwen2-vl-7b")
