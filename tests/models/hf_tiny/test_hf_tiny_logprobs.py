"""Beyond greedy ids: the backend's log-probabilities equal transformers' (float32) on one
configuration of every hf_tiny architecture, so sampling sees the model's own distribution
(whatever the forward does to the logits after the LM head: soft-capping, a logit scale)."""

from __future__ import annotations

import pytest

from hf_reference import hf_greedy_logprobs
from hf_tiny_cases import hf_tiny, image_requests  # noqa: F401 - the fixture
from mmkit import LLM, SamplingParams
from mmkit.testing.hf_tiny import SPECS, hf_tiny_names

# The first configuration of each architecture.
FIRST = sorted({SPECS[n].architecture: n for n in reversed(hf_tiny_names())}.values())


@pytest.mark.parametrize("name", FIRST)
def test_logprobs_match_transformers(hf_tiny, name):
    path = hf_tiny(name)
    request = image_requests(name)["one_image"]
    want_ids, want = hf_greedy_logprobs(path, request, 3)
    llm = LLM(model=str(path), dtype="float32", model_impl="transformers", seed=0)
    out = llm.generate({"prompt": request["prompt"], "multi_modal_data": {"image": request["images"]}},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    got_ids = list(out.outputs[0].token_ids)
    assert got_ids == want_ids
    got = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got_ids)]
    assert got == pytest.approx(want, abs=2e-4), (got, want)
