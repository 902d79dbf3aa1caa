"""mmkit's transformers backend (`model_impl="transformers"`) against transformers' own greedy
ids (float32, EOS ignored) on every hf_tiny architecture (two configurations each), through the
core's `assert_backend_parity`: a mixed batch (text only where the processor accepts it, one
image, two images of different sizes, a token-id prompt with its image span written out) in one
`generate`; the same with
chunked prefill splitting the image spans, with forced preemption, and with a prefix-cache hit."""

from __future__ import annotations

import pytest

from conftest import make_image
from hf_reference import hf_greedy, request_inputs
from hf_tiny_cases import hf_tiny, image_requests  # noqa: F401 - the fixture
from mmkit.testing.backend_parity import ParityCase, assert_backend_parity
from mmkit.testing.hf_tiny import hf_tiny_names

def parity_cases(path, name: str) -> list[ParityCase]:
    cases = [ParityCase(r["prompt"], list(r.get("images") or []), name=kind)
             for kind, r in image_requests(name).items()]
    # A token-id prompt holding an image span already written out (the processor's own ids for
    # an image of the same size, another image given).
    one = image_requests(name)["one_image"]
    ids = request_inputs(str(path), one)["input_ids"][0].tolist()
    cases.append(ParityCase(ids, [make_image(4, 40, 30)], text=one["prompt"], name="token ids + image"))
    return cases


def reference_for(path):
    def reference(case: ParityCase, max_new_tokens: int) -> list[int]:
        if isinstance(case.prompt, list) and not case.images:
            request = {"prompt_token_ids": case.prompt}
        else:
            request = {"prompt": case.reference_text(), "images": case.images}
        return hf_greedy(path, request, max_new_tokens)
    return reference


@pytest.mark.parametrize("name", hf_tiny_names())
def test_backend_matches_transformers(hf_tiny, name):
    path = hf_tiny(name)
    assert_backend_parity(path, parity_cases(path, name), model_impl="transformers", max_tokens=4,
                          reference=reference_for(path))
