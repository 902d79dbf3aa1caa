"""The reference itself: for every hf_tiny checkpoint, transformers' `generate` (KV cache, EOS
ignored) gives the same greedy ids as recomputing the whole sequence with `forward` at every
step, for text-only, one-image and two-image prompts; and the processor writes one image-token
per feature row the model's own `get_image_features` returns. Parity tests compare mmkit's
transformers backend with `hf_greedy`, so it must be self-consistent first."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy, hf_greedy_no_cache, hf_model, request_inputs
from mmkit.testing.hf_tiny import SPECS, hf_tiny_names
from hf_tiny_cases import hf_tiny, image_requests  # noqa: F401 - the fixture

MAX_TOKENS = 5


@pytest.mark.parametrize("name", hf_tiny_names())
def test_generate_matches_stepwise_forward(hf_tiny, name):
    path = hf_tiny(name)
    model, _ = hf_model(str(path))
    assert type(model).__name__ == SPECS[name].architecture
    outputs = {}
    for kind, request in image_requests(name).items():
        ids = hf_greedy(path, request, MAX_TOKENS)
        assert len(ids) == MAX_TOKENS
        stepwise = hf_greedy_no_cache(path, request, MAX_TOKENS)
        assert ids[:len(stepwise)] == stepwise, (name, kind)
        outputs[kind] = ids
    # The images matter: the same prompt text with another image gives other ids somewhere.
    assert len({tuple(v) for v in outputs.values()}) > 1, outputs


@pytest.mark.parametrize("name", hf_tiny_names())
def test_processor_spans_match_feature_rows(hf_tiny, name):
    """Every image token the processor wrote gets one row of the model's own features."""
    path = hf_tiny(name)
    model, processor = hf_model(str(path))
    request = image_requests(name)["two_images"]
    inputs = request_inputs(str(path), request)
    image_token_id = model.config.image_token_id
    num_tokens = int((inputs["input_ids"] == image_token_id).sum())
    feature_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "token_type_ids",
                                                                    "mm_token_type_ids")}
    owner = model if hasattr(model, "get_image_features") else model.model
    with torch.no_grad():
        features = owner.get_image_features(**feature_inputs)
    if hasattr(features, "pooler_output"):
        features = features.pooler_output
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    hidden = model.config.get_text_config().hidden_size
    assert features.reshape(-1, hidden).shape[0] == num_tokens
    assert num_tokens > 0
