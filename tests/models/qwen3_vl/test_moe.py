"""The mixture-of-experts MLP (models/moe.py): the block equals transformers' Qwen3-VL-MoE block
bit for bit (float32), layers follow transformers' sparse-step rule, and greedy ids of a
Qwen3-VL-MoE are identical at batch 1 and batch 64. (Parity with transformers and the hub's
transposed experts: tests/models/qwen3_vl/test_qwen3_vl.py.)"""

import pytest
import torch

from mmkit import LLM, SamplingParams
from mmkit.models.moe import SparseMoeBlock, is_moe_layer
from mmkit.testing import build_tiny_checkpoint


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    # 3 decoder layers: 0 and 2 MoE (8 experts, top-2), 1 dense (mlp_only_layers).
    return build_tiny_checkpoint("Qwen3VLMoeForConditionalGeneration", tmp_path_factory.mktemp("moe"), seed=2)


def test_block_equals_transformers_block_bit_for_bit():
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(hidden_size=48, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20)
    torch.manual_seed(0)
    ref = Qwen3VLMoeTextSparseMoeBlock(config)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = SparseMoeBlock(config)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(37, 48)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x[None])[0])
        assert torch.equal(ours(x[:1]), ref(x[None, :1])[0])


def test_moe_layers_follow_sparse_step_and_mlp_only_layers():
    from transformers import Qwen3VLMoeTextConfig

    config = Qwen3VLMoeTextConfig(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_moe_layer(config, i) for i in range(6)] == [False, True, False, False, False, True]


def test_moe_in_the_configured_layers(moe_ckpt):
    layers = LLM(str(moe_ckpt), dtype="float32").llm_engine.model_runner.model.language_model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]


def test_same_ids_at_batch_1_and_batch_64(moe_ckpt):
    llm = LLM(str(moe_ckpt), dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096)
    words = ["sea", "fox", "image", "blue", "circle", "haiku", "shapes", "dog"]
    prompts = [f"the {words[i % 8]} and the {words[i // 8]}" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == single


def test_packed_bf16_experts_equal_unpacked():
    """bf16 on CPU: the experts' oneDNN-packed weights give the unpacked `F.linear` results bit
    for bit; the row-major copies are released and the metric counts what is held."""
    from transformers import Qwen3VLMoeTextConfig

    config = Qwen3VLMoeTextConfig(hidden_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40)
    torch.manual_seed(0)
    block = SparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block = block.to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want, want_one = block(x), block(x[:1])
        block.pack()
        if block.experts._packed is None:
            pytest.skip("oneDNN packing unavailable (MMKIT_PACKED_LINEAR=0 or no mkldnn)")
        assert block.experts.gate_up_proj.numel() == 0 and block.experts.down_proj.numel() == 0
        assert block.experts.weight_nbytes() > 0
        assert torch.equal(block(x), want) and torch.equal(block(x[:1]), want_one)


def test_grouping_benchmark_reports_both_predictions(tmp_path, monkeypatch, capsys):
    """benchmarks/moe_grouping.py on a tiny block (in process): the count model is
    rows * k / experts hit; the calibrated prediction and the measurement are positive ratios
    (no timing asserted)."""
    import json
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "moe.json"
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "moe_grouping.py"
    monkeypatch.setattr(sys, "argv", ["moe_grouping.py", "--experts", "8", "--top-k", "2", "--hidden", "32",
                                      "--inter", "16", "--rows", "8", "--runs", "1", "--threads",
                                      str(torch.get_num_threads()), "--json", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    data = json.loads(out.read_text())
    assert data["predicted_ratio"] == 8 * 2 / data["experts_hit"]
    assert data["measured_ratio"] > 0 and data["calibrated_ratio"] > 0
    assert "count model (rows*k/hit = 8*2/" in capsys.readouterr().out
