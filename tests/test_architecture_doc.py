"""docs/architecture.md's "Files a new family adds" is complete (every built-in family has
those files, and no other module imports or names a family module), and its worked
out-of-tree example runs as written."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import get_llm, make_image
from mmkit import LLM, ModelRegistry, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
# Modules that name families by design: the registration lines the doc lists, and the first
# phase's `from mmkit.processors import LlavaInputProcessor` re-export.
REGISTRATION = {"models/registry.py", "mmkit/testing/__init__.py"}
LEGACY_REEXPORT = {"processors/__init__.py": {"llava"}}


def _section(title: str) -> str:
    start = DOC.index(title)
    ends = [i for i in (DOC.find("\n## ", start + 1), DOC.find("\n### ", start + 1)) if i >= 0]
    return DOC[start:min(ends) if ends else None]


def _family_stems() -> dict[str, list[str]]:
    """Built-in family module stem -> its architectures (from the registry, not from a list)."""
    stems: dict[str, list[str]] = {}
    for arch in ModelRegistry.get_supported_archs():
        model_cls, processor_cls = ModelRegistry.resolve(arch)
        if not model_cls.__module__.startswith("mmkit.models."):
            continue  # registered by a test or a plugin
        stem = model_cls.__module__.rsplit(".", 1)[1]
        assert processor_cls.__module__ == f"mmkit.processors.{stem}", (arch, processor_cls.__module__)
        stems.setdefault(stem, []).append(arch)
    return stems


def test_every_family_has_the_listed_files():
    from mmkit.testing import tiny_architectures

    table = _section("### Files a new family adds")
    listed = re.findall(r"^\| `([^`]*<family>[^`]*)` \|", table, re.M)
    assert listed == ["models/<family>.py", "processors/<family>.py", "mmkit/testing/<family>.py",
                      "tests/models/<family>/test_<family>.py"]
    for path in REGISTRATION:
        assert f"| `{path}` |" in table
    stems = _family_stems()
    assert {"llava", "llava_next", "qwen2_vl", "mistral3", "idefics3", "internvl", "qwen3_vl"} <= set(stems)
    for stem, archs in stems.items():
        for pattern in listed[:3]:  # the code files (test files may cover several families)
            assert (ROOT / pattern.replace("<family>", stem)).is_file(), (stem, pattern)
        assert set(archs) <= set(tiny_architectures()), f"{stem}: no _BUILDERS line for {archs}"


def _family_references(path: Path, stems: set[str]) -> set[str]:
    """Family stems that `path` imports or names as a module path ("mmkit.models.llava:...")."""
    found = set()
    pattern = re.compile(r"mmkit\.(?:models|processors|testing)\.(\w+)")
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        for name in names:
            found.update(m for m in pattern.findall(name) if m in stems)
    return found


def test_no_other_module_names_a_family():
    stems = set(_family_stems())
    own = {f"{folder}/{stem}.py" for stem in stems for folder in ("models", "processors", "mmkit/testing")}
    offenders = {}
    for folder in ("mmkit", "models", "processors"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in own or rel in REGISTRATION:
                continue
            named = _family_references(path, stems) - LEGACY_REEXPORT.get(rel, set())
            if named:
                offenders[rel] = sorted(named)
    assert offenders == {}, f"modules outside the listed files name families: {offenders}"


@pytest.fixture()
def my_vlm(tmp_path, monkeypatch):
    """The doc's example package written to disk and registered; the registry restored after."""
    source = re.search(r"```python\n# my_vlm/__init__.py\n(.*?)```", _section("### A worked out-of-tree family"),
                       re.S).group(1)
    (tmp_path / "my_vlm").mkdir()
    (tmp_path / "my_vlm" / "__init__.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ModelRegistry, "_entries", dict(ModelRegistry._entries))
    import my_vlm

    my_vlm.register()
    yield my_vlm
    sys.modules.pop("my_vlm", None)


def test_the_worked_example_runs(my_vlm, tiny_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["MyVLMForConditionalGeneration"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "MyVLMForConditionalGeneration" in ModelRegistry.get_supported_archs()
    llm = LLM(str(ckpt), dtype="float32")
    assert type(llm.llm_engine.model_runner.model) is my_vlm.MyVLM
    assert type(llm.llm_engine.input_processor) is my_vlm.MyProcessor
    prompts = ["Hello", {"prompt": "USER: <image>\nWhat is in the image? ASSISTANT:",
                         "multi_modal_data": {"image": make_image(5)}}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in get_llm(tiny_ckpt).generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match=r"inputs\[0\]\.multi_modal_data: got a 'video'; "
                                         r"MyVLMForConditionalGeneration takes images only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": [make_image(1)] * 2}}, params, use_tqdm=False)


def test_each_request_field_has_the_one_writer_the_doc_names():
    """docs/architecture.md's "Who writes each field of a request": every assignment to a listed
    field (`x.field = ...`, `+=`, `.append(...)`, ...) lies in its listed module, or in
    engine/sequence.py's own methods, as far as a grep can tell."""
    import subprocess

    table = _section("### Who writes each field of a request")
    rows = re.findall(r"^\| `\w+\.(\w+)` \| (.+) \|$", table, re.M)
    assert {field for field, _ in rows} == {"num_computed_tokens", "status", "block_hashes", "encoder_keys",
                                            "image_hashes"}
    files = subprocess.run(["git", "ls-files", "mmkit", "models", "processors"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    sources = {f: (ROOT / f).read_text() for f in files if f.endswith(".py")}
    for field, owners in rows:
        allowed = set(re.findall(r"`([\w/]+\.py)`", owners)) | {"mmkit/engine/sequence.py"}
        write = re.compile(rf"(?<!self)\.{field}\s*(\+|-)?=(?!=)|\.{field}\.(append|extend|clear|pop|insert)\(")
        writers = {f for f, text in sources.items() if write.search(text)}
        assert writers <= allowed, (field, sorted(writers - allowed))
