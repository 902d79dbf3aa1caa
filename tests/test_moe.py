"""The mixture-of-experts MLP (models/moe.py): the block equals transformers' Qwen3-VL-MoE block
bit for bit (float32), a LLaVA with a Qwen3-MoE decoder (MoE in some layers) gives
transformers' greedy ids, ids are identical at batch 1 and batch 64, and the hub's transposed
expert layout loads to the same model."""

import pytest
import torch

from conftest import assert_generate_matches_hf, resave_checkpoint
from mmkit import LLM, SamplingParams
from mmkit.models.moe import SparseMoeBlock, is_moe_layer
from mmkit.testing import build_tiny_llava
from test_llava_variants import MAX_TOKENS, mixed_batch

# 3 layers: 0 and 2 MoE (8 experts, top-2), 1 dense (mlp_only_layers).
MOE_TEXT = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[1], norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_llava(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("moe"), text_type="qwen3_moe", num_kv_heads=2, head_dim=24,
                            text_layers=3, text_extra=MOE_TEXT, seed=2)


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


def test_llava_with_qwen3_moe_decoder_equals_transformers(moe_llava):
    llm = LLM(str(moe_llava), dtype="float32")
    layers = llm.llm_engine.model_runner.model.language_model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    inputs, refs = mixed_batch(llm.get_tokenizer(), llm.llm_engine.config.model.image_token_id)
    assert_generate_matches_hf(llm, moe_llava, inputs, refs, MAX_TOKENS)


def test_same_ids_at_batch_1_and_batch_64(moe_llava):
    llm = LLM(str(moe_llava), dtype="float32", max_num_seqs=64)
    words = ["sea", "fox", "image", "blue", "circle", "haiku", "shapes", "dog"]
    prompts = [f"the {words[i % 8]} and the {words[i // 8]}" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == single


def test_hub_transposed_experts_load_to_the_same_ids(moe_llava, tmp_path):
    def transpose_experts(state):  # [E, 2I, H] / [E, H, I] -> the hub's [E, H, 2I] / [E, I, H]
        for key in [k for k in state if ".mlp.experts." in k]:
            state[key] = state[key].transpose(1, 2).contiguous()

    hub = resave_checkpoint(moe_llava, tmp_path / "hub", transpose_experts)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Write a haiku about the sea.", "the quick brown fox"]
    want = [o.outputs[0].token_ids for o in LLM(str(moe_llava), dtype="float32").generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in LLM(str(hub), dtype="float32").generate(prompts, params, use_tqdm=False)]
    assert got == want
