"""The Qwen3 decoder (per-head q/k RMSNorm before rotary, head_dim != hidden / heads, no q/k/v
bias) inside LlavaForConditionalGeneration: greedy ids equal transformers' (float32) for a mixed
batch, in the layout transformers 5 saves and the 4.x hub layout; bf16 (C kernels on CPU)
agrees with transformers' bf16."""

import pytest

from conftest import assert_bf16_matches_hf, assert_generate_matches_hf, make_image
from mmkit import LLM
from mmkit.testing import build_tiny_llava, rewrite_hub_layout
from test_llava_variants import MAX_TOKENS, PROMPT1, mixed_batch

# head_dim 24 while hidden / heads = 16; GQA; SigLIP "full" like InternVL-style towers.
QWEN3 = dict(text_type="qwen3", num_kv_heads=2, head_dim=24, vision_type="siglip",
             vision_feature_layer=-1, select_strategy="full", seed=7)


@pytest.fixture(scope="module")
def qwen3_llava(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("qwen3"), **QWEN3)


def test_qwen3_layers_have_qk_norm_and_checkpoint_head_dim(qwen3_llava):
    llm = LLM(str(qwen3_llava), dtype="float32")
    assert llm.llm_engine.config.model.head_dim == 24
    attn = llm.llm_engine.model_runner.model.language_model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (24,) and attn.qkv_proj.bias is None


def test_mixed_batch_equals_transformers_both_layouts(qwen3_llava, tmp_path):
    llm = LLM(str(qwen3_llava), dtype="float32")
    inputs, refs = mixed_batch(llm.get_tokenizer(), llm.llm_engine.config.model.image_token_id)
    assert_generate_matches_hf(llm, qwen3_llava, inputs, refs, MAX_TOKENS)
    hub = rewrite_hub_layout(qwen3_llava, tmp_path / "hub")
    llm = LLM(str(hub), dtype="float32", max_num_batched_tokens=8)  # chunked prefill too
    assert_generate_matches_hf(llm, hub, inputs[:3], refs[:3], MAX_TOKENS)


def test_bf16_agrees_with_transformers_bf16(qwen3_llava):
    """Equal to transformers' bf16 generate, or first different at a bf16 tie of transformers'
    own logits (on other seeds the first divergence was a 1-ulp top-2 tie, where mmkit picked
    float32's token)."""
    image = make_image(9, 50, 40)
    inputs = ["Write a haiku about the sea.", "the quick brown fox",
              {"prompt": PROMPT1, "multi_modal_data": {"image": image}}]
    refs = [dict(prompt=inputs[0]), dict(prompt=inputs[1]), dict(prompt=PROMPT1, images=image)]
    assert_bf16_matches_hf(qwen3_llava, "cpu", inputs, refs)
