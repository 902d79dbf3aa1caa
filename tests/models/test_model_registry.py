"""An out-of-tree family through the public API alone: `mmkit.ModelRegistry` (a class object,
a lazy "module:Class" string, an installed `mmkit.plugins` entry point), greedy ids identical
to transformers, and the registered subclass's methods the ones that run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy, make_image
from mmkit import LLM, ModelRegistry, SamplingParams

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"

# A plugin package: a subclass of the built-in LLaVA family whose methods record their calls.
PLUGIN_SOURCE = '''
from mmkit.models.llava import LlavaForConditionalGeneration
from mmkit.processors.llava import LlavaInputProcessor

CALLS = []
REGISTERED = []


class MyVLM(LlavaForConditionalGeneration):
    def embed_multimodal(self, items):
        CALLS.append("embed_multimodal")
        return super().embed_multimodal(items)

    def compute_logits(self, hidden):
        CALLS.append("compute_logits")
        return super().compute_logits(hidden)


class MyProcessor(LlavaInputProcessor):
    def process(self, parsed):
        CALLS.append("process")
        return super().process(parsed)


def register():
    from mmkit import ModelRegistry

    REGISTERED.append(1)
    ModelRegistry.register_model("MyPluginVLM", "my_vlm_plugin:MyVLM", processor="my_vlm_plugin:MyProcessor")
'''


@pytest.fixture()
def plugin_dir(tmp_path, monkeypatch):
    """`my_vlm_plugin` installed on sys.path with a dist-info naming its `mmkit.plugins` entry point;
    the registry and the once-per-process plugin state restored afterwards."""
    import mmkit.plugins

    (tmp_path / "my_vlm_plugin").mkdir()
    (tmp_path / "my_vlm_plugin" / "__init__.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "my_vlm_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-vlm-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mmkit.plugins]\nmy_vlm = my_vlm_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ModelRegistry, "_entries", dict(ModelRegistry._entries))
    monkeypatch.setattr(mmkit.plugins, "_loaded", None)
    monkeypatch.delenv("MMKIT_PLUGINS", raising=False)
    yield tmp_path
    sys.modules.pop("my_vlm_plugin", None)


def renamed_checkpoint(src: Path, dst: Path, architecture: str) -> Path:
    """A copy of `src` whose config.json names `architecture`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def greedy_ids(llm: LLM, image) -> list[int]:
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("how", ["class", "string", "entry_point"])
def test_out_of_tree_subclass_equals_transformers(tiny_ckpt, tmp_path, plugin_dir, monkeypatch, how):
    if how != "entry_point":
        monkeypatch.setenv("MMKIT_PLUGINS", "")  # an empty list loads no plugin
    arch = {"class": "MyClassVLM", "string": "MyStringVLM", "entry_point": "MyPluginVLM"}[how]
    if how == "class":
        import my_vlm_plugin

        ModelRegistry.register_model(arch, my_vlm_plugin.MyVLM, processor=my_vlm_plugin.MyProcessor)
    elif how == "string":
        ModelRegistry.register_model(arch, "my_vlm_plugin:MyVLM", processor="my_vlm_plugin:MyProcessor")
    assert (arch in ModelRegistry.get_supported_archs()) == (how != "entry_point")  # the plugin: at LLM()
    path = renamed_checkpoint(tiny_ckpt, tmp_path / "ckpt", arch)
    llm = LLM(str(path), dtype="float32", device="cpu")
    import my_vlm_plugin

    assert arch in ModelRegistry.get_supported_archs()
    assert type(llm.llm_engine.model_runner.model) is my_vlm_plugin.MyVLM
    assert ModelRegistry.resolve(arch) == (my_vlm_plugin.MyVLM, my_vlm_plugin.MyProcessor)
    image = make_image(3)
    # transformers loads the renamed checkpoint by its model_type (LLaVA).
    assert greedy_ids(llm, image) == hf_greedy(path, prompt=PROMPT, images=image, max_new_tokens=12)
    assert {"process", "embed_multimodal", "compute_logits"} <= set(my_vlm_plugin.CALLS)
    assert my_vlm_plugin.REGISTERED == ([1] if how == "entry_point" else [])


def test_plugins_load_once_and_mmkit_plugins_selects(plugin_dir, monkeypatch):
    import mmkit.plugins

    monkeypatch.setenv("MMKIT_PLUGINS", "someone_else")
    assert mmkit.plugins.load_plugins() == []
    assert "MyPluginVLM" not in ModelRegistry.get_supported_archs()
    monkeypatch.setattr(mmkit.plugins, "_loaded", None)
    monkeypatch.setenv("MMKIT_PLUGINS", "someone_else, my_vlm")
    assert mmkit.plugins.load_plugins() == ["my_vlm"]
    assert mmkit.plugins.load_plugins() == ["my_vlm"]  # once per process
    import my_vlm_plugin

    assert my_vlm_plugin.REGISTERED == [1] and "MyPluginVLM" in ModelRegistry.get_supported_archs()


def test_failing_plugin_names_itself(plugin_dir, monkeypatch):
    import mmkit.plugins

    (plugin_dir / "my_vlm_plugin" / "__init__.py").write_text("def register():\n    raise OSError('boom')\n")
    with pytest.raises(RuntimeError, match="'my_vlm'.*boom"):
        mmkit.plugins.load_plugins()


def test_unknown_architecture_lists_every_registered_one(tiny_ckpt, tmp_path, plugin_dir):
    ModelRegistry.register_model("MyStringVLM", "my_vlm_plugin:MyVLM", processor="my_vlm_plugin:MyProcessor")
    path = renamed_checkpoint(tiny_ckpt, tmp_path / "ckpt", "NoSuchVLMForConditionalGeneration")
    with pytest.raises(ValueError, match="NoSuchVLMForConditionalGeneration") as info:
        LLM(str(path), dtype="float32", device="cpu")
    archs = ModelRegistry.get_supported_archs()
    assert archs == sorted(archs) and {"MyStringVLM", "MyPluginVLM", "LlavaForConditionalGeneration",
                                       "Qwen2VLForConditionalGeneration"} <= set(archs)
    assert str(archs) in str(info.value)


def test_register_model_checks_its_arguments():
    with pytest.raises(TypeError, match="architecture"):
        ModelRegistry.register_model("", "a:B", processor="a:C")
    with pytest.raises(ValueError, match="module:Class"):
        ModelRegistry.register_model("X", "no_colon", processor="a:C")
    with pytest.raises(TypeError, match="processor"):
        ModelRegistry.register_model("X", "a:B", processor=3)
    assert "X" not in ModelRegistry.get_supported_archs()


def test_a_lazy_reference_that_does_not_import_names_itself(monkeypatch):
    monkeypatch.setattr(ModelRegistry, "_entries", dict(ModelRegistry._entries))
    ModelRegistry.register_model("BrokenVLM", "no_such_module_xyz:Model", processor="no_such_module_xyz:P")
    with pytest.raises(ValueError, match="no_such_module_xyz:Model"):
        ModelRegistry.resolve("BrokenVLM")


def test_builtin_families_register_through_the_public_call():
    source = (Path(__file__).resolve().parents[2] / "models" / "registry.py").read_text()
    for arch in ModelRegistry.get_supported_archs():
        assert f'_register("{arch}",' in source


@pytest.mark.parametrize("config_name, arch, supported", [
    ("LlavaConfig", "LlavaForConditionalGeneration", "['llama', 'mistral', 'qwen2', 'qwen3']"),
    ("InternVLConfig", "InternVLForConditionalGeneration", "['llama', 'mistral', 'qwen2', 'qwen3']"),
    ("Mistral3Config", "Mistral3ForConditionalGeneration", "['mistral', 'llama']"),
    ("Idefics3Config", "Idefics3ForConditionalGeneration", "['llama']"),
])
def test_unsupported_decoder_names_architecture_and_supported_ones(config_name, arch, supported):
    """Every composite family refuses a decoder mmkit does not compute, with one message form."""
    import transformers

    config = getattr(transformers, config_name)(text_config={"model_type": "gemma"})
    config.architectures = [arch]
    with pytest.raises(ValueError) as err:
        ModelRegistry.architecture_of(config)
    assert str(err.value) == (f"model: {arch} with a 'gemma' language model is not supported; "
                              f"supported language models: {supported}")
