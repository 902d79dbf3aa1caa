"""The tiny checkpoints of the transformers-backend architectures (mmkit.testing.hf_tiny), built once
per session, and the prompts every hf_tiny test sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_image
from mmkit.testing.hf_tiny import SPECS, build_hf_tiny

_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """hf_tiny(name) -> the checkpoint folder of `name`, built on first use."""
    def get(name: str) -> Path:
        if name not in _BUILT:
            _BUILT[name] = build_hf_tiny(name, tmp_path_factory.mktemp(name.replace("/", "-")))
        return _BUILT[name]
    return get


def image_requests(name: str) -> dict[str, dict]:
    """The requests of a mixed batch: text only (where the processor accepts it), one image, two
    images of different sizes (and aspect ratios) in one prompt."""
    ph = SPECS[name].placeholder
    requests = {
        "one_image": {"prompt": f"USER: {ph} What is in the image? ASSISTANT:", "images": [make_image(1, 40, 30)]},
        "two_images": {"prompt": f"USER: {ph} and {ph} Compare them. ASSISTANT:",
                       "images": [make_image(2, 70, 30), make_image(3, 40, 48)]},
    }
    if not SPECS[name].needs_image:
        requests["text"] = {"prompt": "Write a haiku about the sea."}
    return requests
