"""The hf_tiny registry: every name builds a checkpoint of the architecture it claims, with two or
more configurations per architecture that really differ, and the docs' table of architectures
verified through the backend names each of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tiny_cases import hf_tiny  # noqa: F401 - the fixture
from mmkit.testing.hf_tiny import SPECS, build_hf_tiny, hf_tiny_names

DOCS = Path(__file__).resolve().parents[3] / "docs" / "transformers_backend.md"


def test_every_architecture_has_two_configurations_that_differ(hf_tiny):
    by_arch: dict[str, list[str]] = {}
    for name in hf_tiny_names() + hf_tiny_names(refused=True):
        by_arch.setdefault(SPECS[name].architecture, []).append(name)
    assert len(by_arch) >= 8
    for arch, names in by_arch.items():
        assert len(names) >= 2, arch
        configs = [json.loads((hf_tiny(n) / "config.json").read_text()) for n in names]
        assert all(c["architectures"] == [arch] for c in configs)
        text = [c.get("text_config", c) for c in configs]
        assert text[0] != text[1], f"{arch}: its configurations build the same text config"
        assert (hf_tiny(names[0]) / "processor_config.json").exists() or \
            (hf_tiny(names[0]) / "preprocessor_config.json").exists(), f"{arch}: no processor saved"


def test_docs_table_names_every_verified_architecture():
    table = DOCS.read_text()
    missing = sorted(a for a in {SPECS[n].architecture for n in hf_tiny_names()} if f"`{a}`" not in table)
    assert not missing, f"docs/transformers_backend.md does not list {missing}"


def test_unknown_name_lists_the_available_ones(tmp_path):
    with pytest.raises(ValueError, match=r"no tiny checkpoint 'llama4/nope'; available: \[.*'llama4/moe'"):
        build_hf_tiny("llama4/nope", tmp_path)
