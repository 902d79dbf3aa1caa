"""model_impl and the backend's qualification: refusals name the reason and the model_impl to
try, and come before any weight is read (the checkpoint folders below hold only config.json)."""

from __future__ import annotations

import pytest
from transformers import Florence2Config, Lfm2VlConfig, MllamaConfig

from mmkit import LLM, EngineArgs, ModelRegistry


def _config_only(tmp_path, config, architecture):
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("config, architecture, reason", [
    (Lfm2VlConfig, "Lfm2VlForConditionalGeneration", "hybrid model"),
    (MllamaConfig, "MllamaForConditionalGeneration", "cross-attention layers"),
    (Florence2Config, "Florence2ForConditionalGeneration", "encoder-decoder model"),
])
def test_out_of_scope_architectures_are_refused_by_name(tmp_path, model_impl, config, architecture, reason):
    if ModelRegistry.is_supported(architecture) and model_impl == "auto":
        # LFM2-VL has a native hybrid family now (models/lfm2_vl.py): auto runs it natively
        assert ModelRegistry.get_implementation(architecture) == "mmkit"
        return
    path = _config_only(tmp_path, config(), architecture)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", model_impl=model_impl)
    message = str(info.value)
    assert architecture in message and reason in message and "model_impl='transformers'" in message
    if ModelRegistry.is_supported(architecture):
        assert "model_impl='mmkit'" in message  # the backend points to the native family
    else:
        assert "register_model" in message  # what would run it: a native implementation
    assert "safetensors" not in message.lower()  # refused from the config, no weight looked for


def test_a_native_architecture_refused_by_the_backend_points_to_model_impl_mmkit(tmp_path):
    config = Lfm2VlConfig()
    config.architectures = ["LlavaForConditionalGeneration"]  # a native name on a hybrid config
    from mmkit.models.transformers_backend import BackendUnsupportedError, check_backend_supports

    with pytest.raises(BackendUnsupportedError, match="model_impl='mmkit'"):
        check_backend_supports(config, "LlavaForConditionalGeneration", native=True)


def test_model_impl_mmkit_without_a_native_family_says_the_backend_runs_it(tmp_path):
    from transformers import PaliGemmaConfig

    path = _config_only(tmp_path, PaliGemmaConfig(), "PaliGemmaForConditionalGeneration")
    with pytest.raises(ValueError, match="has no native mmkit implementation.*model_impl='transformers' runs it"):
        LLM(str(path), dtype="float32", model_impl="mmkit")


def test_model_impl_values_are_checked():
    with pytest.raises(ValueError, match=r"model_impl: got 'vllm'; expected one of \['auto', 'mmkit', 'transformers'\]"):
        EngineArgs(model_impl="vllm").create_engine_config()


def test_registry_reports_which_implementation_runs_an_architecture():
    assert ModelRegistry.get_implementation("LlavaForConditionalGeneration") == "mmkit"
    assert ModelRegistry.get_implementation("LlavaForConditionalGeneration", "transformers") == "transformers"
    assert ModelRegistry.get_implementation("PaliGemmaForConditionalGeneration") == "transformers"
    assert ModelRegistry.get_implementation("Glm4vForConditionalGeneration") == "transformers"
    with pytest.raises(ValueError, match="cross-attention"):
        ModelRegistry.get_implementation("MllamaForConditionalGeneration")
    with pytest.raises(ValueError, match="has no class 'NoSuchVLM'"):
        ModelRegistry.get_implementation("NoSuchVLM")


def test_cli_and_serve_take_model_impl():
    from mmkit.entrypoints.cli.main import build_parser
    from mmkit.entrypoints.openai.api_server import build_engine_args

    parser = build_parser()
    for command in (["caption", "x.png"], ["ask", "x.png", "q"], ["eval", "d.jsonl", "--output", "r.jsonl"], ["serve"]):
        args = parser.parse_args(command + ["--model-impl", "transformers"])
        assert args.model_impl == "transformers", command
        if command[0] == "serve":
            assert build_engine_args(args).model_impl == "transformers"
    with pytest.raises(SystemExit):
        parser.parse_args(["caption", "x.png", "--model-impl", "vllm"])
