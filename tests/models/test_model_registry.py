"""An out-of-tree family through the public API alone: `mmkit.ModelRegistry` (a class object,
a lazy "module:Class" string, an installed `mmkit.plugins` entry point), greedy ids identical
to transformers, and the registered subclass's methods the ones that run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import blocks_held_while_decoding, hf_greedy, make_image
from mmkit import LLM, ModelRegistry, SamplingParams

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"

# A plugin package: a subclass of the built-in LLaVA family whose methods record their calls,
# and a family that declares a capability of its own (`MyWindowVLM`).
PLUGIN_SOURCE = '''
from dataclasses import replace

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


class MyWindowVLM(LlavaForConditionalGeneration):
    """A family whose checkpoint names its attention window its own way (`my_attention_window`,
    every layer): it declares the window once, and its decoder layers apply the declaration."""

    @classmethod
    def get_capabilities(cls, hf_config):
        declared = super().get_capabilities(hf_config)
        windows = (hf_config.my_attention_window,) * len(declared.layer_sliding_windows)
        return replace(declared, layer_sliding_windows=windows)

    def __init__(self, config, max_positions):
        super().__init__(config, max_positions)
        windows = self.get_capabilities(config).layer_sliding_windows
        for layer, window in zip(self.language_model.layers, windows):
            layer.self_attn.sliding_window = window


def register():
    from mmkit import ModelRegistry

    REGISTERED.append(1)
    ModelRegistry.register_model("MyPluginVLM", "my_vlm_plugin:MyVLM", processor="my_vlm_plugin:MyProcessor")
    ModelRegistry.register_model("MyWindowVLM", "my_vlm_plugin:MyWindowVLM", processor="my_vlm_plugin:MyProcessor")
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


def test_plugin_family_declares_a_sliding_window_the_engine_honours(tmp_path, plugin_dir):
    """A family from a temporary folder, registered through the `mmkit.plugins` entry point,
    declares a 32-token window on every layer from a config key of its own. The engine's config
    shows the declaration, the block manager frees blocks out of the window while decoding, and
    greedy ids past the window equal transformers' for the same decoder with `sliding_window=32`
    (and differ from full attention: the declaration is what ran)."""
    import math

    from mmkit.testing import build_tiny_llava

    window, block_size = 32, 16
    ref_path = build_tiny_llava(tmp_path / "ref", text_type="mistral", sliding_window=window, seed=5,
                                max_position_embeddings=1024)
    path = tmp_path / "plugin"
    shutil.copytree(ref_path, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MyWindowVLM"]
    config["text_config"]["sliding_window"] = None  # the window is the family's own key now
    config["my_attention_window"] = window
    (path / "config.json").write_text(json.dumps(config))

    llm = LLM(str(path), dtype="float32", device="cpu", block_size=block_size, enable_prefix_caching=False)
    import my_vlm_plugin

    assert type(llm.llm_engine.model_runner.model) is my_vlm_plugin.MyWindowVLM
    capabilities = llm.llm_engine.config.model.capabilities
    assert capabilities.layer_sliding_windows == (window, window) and capabilities.sliding_window == window
    assert llm.llm_engine.block_manager.sliding_window == window

    filler = " the quick brown fox jumps over the lazy dog" * 8
    prompts = [f"USER: <image>\n{filler} What is in the image? ASSISTANT:",  # the image leaves the window
               f"USER:{filler} Now look: <image>\nWhat is it? ASSISTANT:"]
    images = [make_image(3), make_image(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)],
                        params, use_tqdm=False)
    assert all(len(o.prompt_token_ids) > 3 * window for o in outs)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(ref_path, prompt=p, images=im, max_new_tokens=24, ignore_eos=True)
                   for p, im in zip(prompts, images)]
    full = renamed_checkpoint(path, tmp_path / "full", "LlavaForConditionalGeneration")  # no window anywhere
    full_llm = LLM(str(full), dtype="float32", device="cpu")
    assert full_llm.llm_engine.config.model.capabilities.sliding_window is None
    assert [o.outputs[0].token_ids for o in full_llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], params,
        use_tqdm=False)] != got

    # Decoding holds only the blocks the window reads (generic code frees the rest).
    engine = llm.llm_engine
    engine.add_request("long", {"prompt": prompts[0], "multi_modal_data": {"image": images[0]}},
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    held_max, steps = blocks_held_while_decoding(llm)
    assert steps >= 200 and 0 < held_max <= math.ceil(window / block_size) + 1


def test_capabilities_declaration_is_checked(tiny_ckpt, tmp_path, plugin_dir, monkeypatch):
    """A model class without `get_capabilities`, or one declaring windows for another number of
    layers, is refused when the engine config is built, naming the class (no weight is read)."""
    monkeypatch.setenv("MMKIT_PLUGINS", "")
    import my_vlm_plugin

    class Undeclared:
        pass

    class WrongWindows(my_vlm_plugin.MyVLM):
        @classmethod
        def get_capabilities(cls, hf_config):
            from dataclasses import replace

            return replace(super().get_capabilities(hf_config), layer_sliding_windows=(8,))

    for name, cls, error, match in [
            ("UndeclaredVLM", Undeclared, TypeError, "Undeclared declares no get_capabilities"),
            ("WrongWindowsVLM", WrongWindows, ValueError, "declares 1 layer sliding windows; expected one per "
                                                          r"decoder layer \(2\)")]:
        ModelRegistry.register_model(name, cls, processor=my_vlm_plugin.MyProcessor)
        path = renamed_checkpoint(tiny_ckpt, tmp_path / name, name)
        with pytest.raises(error, match=match):
            LLM(str(path), dtype="float32", device="cpu")


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
