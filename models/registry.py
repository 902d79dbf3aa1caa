"""`ModelRegistry`: HF `architectures[0]` -> (model class, input processor class).

The one table every family registers in, built-in and out-of-tree alike (vLLM's
`ModelRegistry` for out-of-tree models):

    from mmkit import ModelRegistry
    ModelRegistry.register_model("MyVLMForConditionalGeneration",   # HF architectures[0]
                                 "my_pkg.model:MyVLM",               # a class, or "module:Class"
                                 processor="my_pkg.processor:MyProcessor")

A "module:Class" string is imported on first use, so registering costs nothing. Plugins
(`mmkit.plugins` entry points, see mmkit/plugins.py) register the same way.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any

def _import_ref(ref: Any, what: str) -> type:
    if not isinstance(ref, str):
        return ref
    module_name, _, class_name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot import {ref!r} ({exc})") from exc


def _check_ref(name: str, ref: Any) -> None:
    if isinstance(ref, type):
        return
    if isinstance(ref, str):
        module_name, sep, class_name = ref.partition(":")
        if sep and module_name and class_name.isidentifier():
            return
        raise ValueError(f"{name}: got {ref!r}; expected a class or a 'module:Class' string")
    raise TypeError(f"{name}: got {type(ref).__name__}; expected a class or a 'module:Class' string")


@dataclass
class _Entry:
    model: Any  # class or "module:Class"
    processor: Any


class _ModelRegistry:
    """Architectures mmkit can run; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_model_type: dict[str, str] = {}
        self._lock = threading.Lock()

    def register_model(self, architecture: str, model_cls: Any, *, processor: Any,
                       model_types: tuple[str, ...] = ()) -> None:
        """Register (or replace) `architecture`, the name a checkpoint's `config.json` gives in
        `architectures[0]`. `model_cls` implements `mmkit.models.interfaces.SupportsMultiModal`,
        `processor` `mmkit.processors.base.InputProcessor`; each a class or a "module:Class"
        string. `model_types`: HF `model_type`s that select it in a config without `architectures`."""
        if not isinstance(architecture, str) or not architecture:
            raise TypeError(f"architecture: got {architecture!r}; expected a non-empty string "
                            "(the checkpoint's architectures[0])")
        _check_ref("model_cls", model_cls)
        _check_ref("processor", processor)
        with self._lock:
            if architecture in self._entries:
                warnings.warn(f"ModelRegistry: architecture {architecture!r} was already registered; "
                              "the new registration replaces it", stacklevel=2)
            self._entries[architecture] = _Entry(model_cls, processor)
            for model_type in model_types:
                self._by_model_type[model_type] = architecture

    def get_supported_archs(self) -> list[str]:
        """Every registered architecture (built-in and out-of-tree), sorted."""
        with self._lock:
            return sorted(self._entries)

    def is_supported(self, architecture: str) -> bool:
        with self._lock:
            return architecture in self._entries

    def resolve(self, architecture: str, model_impl: str = "mmkit") -> tuple[type, type]:
        """(model class, input processor class) of `architecture`; lazy references are
        imported here (and kept). `model_impl="transformers"`: the transformers backend's
        classes (models/transformers_backend/), whatever is registered."""
        if model_impl == "transformers":
            from mmkit.models.transformers_backend import TransformersBackendModel
            from mmkit.processors.transformers_backend import TransformersInputProcessor

            return TransformersBackendModel, TransformersInputProcessor
        with self._lock:
            entry = self._entries.get(architecture)
        if entry is None:
            raise ValueError(f"model: architecture {architecture!r} is not supported; supported "
                             f"architectures: {self.get_supported_archs()}")
        model_cls = _import_ref(entry.model, f"model class of {architecture}")
        processor_cls = _import_ref(entry.processor, f"processor of {architecture}")
        with self._lock:
            if self._entries.get(architecture) is entry:
                entry.model, entry.processor = model_cls, processor_cls
        return model_cls, processor_cls

    def architecture_of(self, hf_config: Any) -> str:
        """The registered architecture of a checkpoint config (an old config without
        `architectures` by its `model_type`), checked by the model class's `check_config`."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if archs:
            arch = archs[0]
        else:
            with self._lock:
                arch = self._by_model_type.get(getattr(hf_config, "model_type", None))
        model_cls, _ = self.resolve(arch)
        check = getattr(model_cls, "check_config", None)
        if check is not None:
            check(hf_config)
        return arch


    def select(self, hf_config: Any, model_impl: str = "auto") -> tuple[str, str]:
        """(architecture, implementation) that runs a checkpoint config: "mmkit" (a registered
        family) or "transformers" (the backend). `model_impl`: "auto" (native when registered,
        else the backend when the architecture qualifies), "mmkit" or "transformers". An
        unsupported choice is a ValueError naming the reason and the model_impl to try; nothing
        here reads weights."""
        from mmkit.models.transformers_backend.qualify import MODEL_IMPLS, check_backend_supports

        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: got {model_impl!r}; expected one of {list(MODEL_IMPLS)}")
        archs = list(getattr(hf_config, "architectures", None) or [])
        with self._lock:
            native_arch = archs[0] if archs and archs[0] in self._entries else (
                None if archs else self._by_model_type.get(getattr(hf_config, "model_type", None)))
        if model_impl == "mmkit" or (model_impl == "auto" and native_arch is not None):
            if native_arch is None and archs:
                try_backend = "" if transformers_refusal(hf_config, archs[0]) else \
                    "; model_impl='transformers' runs it through transformers' own modules"
                raise ValueError(f"model: architecture {archs[0]!r} has no native mmkit implementation "
                                 f"(model_impl={model_impl!r}){try_backend}; native architectures: "
                                 f"{self.get_supported_archs()}")
            return self.architecture_of(hf_config), "mmkit"
        if not archs:
            raise ValueError(f"model: the config names no architectures (model_type "
                             f"{getattr(hf_config, 'model_type', None)!r}); the transformers backend needs "
                             "architectures[0]; native architectures: " + str(self.get_supported_archs()))
        if model_impl == "auto":
            reason = transformers_refusal(hf_config, archs[0])
            if reason is not None:
                raise ValueError(f"model: architecture {archs[0]!r} is not supported; supported architectures: "
                                 f"{self.get_supported_archs()} (native), and the transformers backend refuses it: "
                                 + reason.split(": ", 1)[1])
        check_backend_supports(hf_config, archs[0], native=native_arch is not None)
        return archs[0], "transformers"

    def get_implementation(self, architecture: str | Any, model_impl: str = "auto") -> str:
        """Which implementation runs `architecture` (a name, or a checkpoint's HF config for the
        full check): "mmkit" (native) or "transformers" (the backend); a ValueError naming the
        reason when neither can."""
        if isinstance(architecture, str):
            from types import SimpleNamespace

            from mmkit.models.transformers_backend.qualify import transformers_class

            cls = transformers_class(architecture)
            try:  # the class's default config: enough to see what kind of decoder it is
                config = cls.config_class() if cls is not None and getattr(cls, "config_class", None) else None
            except Exception:  # noqa: BLE001 - a config class that needs arguments
                config = None
            if config is None:
                config = SimpleNamespace(architectures=[architecture], model_type=None,
                                         get_text_config=lambda: SimpleNamespace())
            config.architectures = [architecture]
            return self.select(config, model_impl)[1]
        return self.select(architecture, model_impl)[1]


def transformers_refusal(hf_config: Any, architecture: str) -> str | None:
    from mmkit.models.transformers_backend.qualify import backend_refusal

    return backend_refusal(hf_config, architecture)


ModelRegistry = _ModelRegistry()


def supported_architectures() -> list[str]:
    return ModelRegistry.get_supported_archs()


def resolve_architecture(hf_config: Any) -> str:
    return ModelRegistry.architecture_of(hf_config)


def get_model_class(architecture: str) -> type:
    return ModelRegistry.resolve(architecture)[0]


# HF model_type of text_config -> the mmkit decoder that computes it exactly (a composite
# family's decoder part, chosen by `text_model_class`).
_TEXT_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("mmkit.models.llama", "LlamaModel"),
    "mistral": ("mmkit.models.llama", "LlamaModel"),
    "qwen2": ("mmkit.models.llama", "LlamaModel"),
    "qwen3": ("mmkit.models.qwen3", "Qwen3Model"),
}
SUPPORTED_TEXT_MODELS = tuple(_TEXT_MODELS)


def text_model_class(text_config: Any):
    """The decoder class for a composite model's `text_config` (checked by its `check_config`)."""
    module_name, class_name = _TEXT_MODELS[text_config.model_type]
    return getattr(importlib.import_module(module_name), class_name)


def check_text_model(architecture: str, hf_config: Any,
                     supported: tuple[str, ...] = SUPPORTED_TEXT_MODELS) -> None:
    """A composite family's decoder must be one mmkit computes exactly (`supported`: the HF
    `model_type`s of text_config the family accepts; default every decoder mmkit has)."""
    text_type = getattr(hf_config.get_text_config(), "model_type", None)
    if text_type not in supported:
        raise ValueError(f"model: {architecture} with a {text_type!r} language model is not supported; "
                         f"supported language models: {list(supported)}")


def ties_word_embeddings(config: Any) -> bool:
    """Whether the config asks for the LM head to share the embedding matrix, by transformers'
    rule (5.17-5.25): `tie_weights` reads `tie_word_embeddings` of the config of the class that
    owns `lm_head` (the composite's, `_tied_weights_keys`), never its text_config's. Where a
    family forwards text_config's flag to the top (LLaVA, OneVision, Qwen2/2.5-VL), its config
    class already did so when AutoConfig read it. NOTE: a Qwen3-VL(-MoE) or Gemma 3 text_config
    defaults to True while the composite says False: not tied. `weight_utils.load_vlm_checkpoint`
    applies transformers' checkpoint exception (both tensors present and different: not tied)."""
    return bool(getattr(config, "tie_word_embeddings", False))


# Built-in families: one line per architecture, registered through the public call.
_register = ModelRegistry.register_model
# LLaVA (models/llava.py, processors/llava.py)
_register("LlavaForConditionalGeneration", "mmkit.models.llava:LlavaForConditionalGeneration",
          processor="mmkit.processors.llava:LlavaInputProcessor", model_types=("llava",))
# LLaVA-NeXT and OneVision (models/llava_next.py, processors/llava_next.py)
_register("LlavaNextForConditionalGeneration", "mmkit.models.llava_next:LlavaNextForConditionalGeneration",
          processor="mmkit.processors.llava_next:LlavaNextInputProcessor", model_types=("llava_next",))
_register("LlavaOnevisionForConditionalGeneration", "mmkit.models.llava_next:LlavaOnevisionForConditionalGeneration",
          processor="mmkit.processors.llava_next:LlavaOnevisionInputProcessor", model_types=("llava_onevision",))
# Qwen2-VL and Qwen2.5-VL (models/qwen2_vl.py, processors/qwen2_vl.py)
_register("Qwen2VLForConditionalGeneration", "mmkit.models.qwen2_vl:Qwen2VLForConditionalGeneration",
          processor="mmkit.processors.qwen2_vl:Qwen2VLInputProcessor", model_types=("qwen2_vl",))
_register("Qwen2_5_VLForConditionalGeneration", "mmkit.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
          processor="mmkit.processors.qwen2_vl:Qwen2VLInputProcessor", model_types=("qwen2_5_vl",))
# Mistral 3 (models/mistral3.py, processors/mistral3.py)
_register("Mistral3ForConditionalGeneration", "mmkit.models.mistral3:Mistral3ForConditionalGeneration",
          processor="mmkit.processors.mistral3:Mistral3InputProcessor", model_types=("mistral3",))
# Idefics3 and SmolVLM (models/idefics3.py, processors/idefics3.py)
_register("Idefics3ForConditionalGeneration", "mmkit.models.idefics3:Idefics3ForConditionalGeneration",
          processor="mmkit.processors.idefics3:Idefics3InputProcessor", model_types=("idefics3",))
_register("SmolVLMForConditionalGeneration", "mmkit.models.idefics3:SmolVLMForConditionalGeneration",
          processor="mmkit.processors.idefics3:SmolVLMInputProcessor", model_types=("smolvlm",))
# Gemma 3 (models/gemma3.py, processors/gemma3.py)
_register("Gemma3ForConditionalGeneration", "mmkit.models.gemma3:Gemma3ForConditionalGeneration",
          processor="mmkit.processors.gemma3:Gemma3InputProcessor", model_types=("gemma3",))
# InternVL -HF (models/internvl.py, processors/internvl.py)
_register("InternVLForConditionalGeneration", "mmkit.models.internvl:InternVLForConditionalGeneration",
          processor="mmkit.processors.internvl:InternVLInputProcessor", model_types=("internvl",))
# Qwen3-VL and Qwen3-VL-MoE (models/qwen3_vl.py, processors/qwen3_vl.py)
_register("Qwen3VLForConditionalGeneration", "mmkit.models.qwen3_vl:Qwen3VLForConditionalGeneration",
          processor="mmkit.processors.qwen3_vl:Qwen3VLInputProcessor", model_types=("qwen3_vl",))
_register("Qwen3VLMoeForConditionalGeneration", "mmkit.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
          processor="mmkit.processors.qwen3_vl:Qwen3VLInputProcessor", model_types=("qwen3_vl_moe",))
# Qwen3.5 and Qwen3.5-MoE, hybrid decoders (models/qwen3_5.py; Qwen3-VL's processor)
_register("Qwen3_5ForConditionalGeneration", "mmkit.models.qwen3_5:Qwen3_5ForConditionalGeneration",
          processor="mmkit.processors.qwen3_5:Qwen3_5InputProcessor", model_types=("qwen3_5",))
_register("Qwen3_5MoeForConditionalGeneration", "mmkit.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
          processor="mmkit.processors.qwen3_5:Qwen3_5InputProcessor", model_types=("qwen3_5_moe",))
# LFM2-VL, a hybrid decoder of short convolutions and attention (models/lfm2_vl.py, processors/lfm2_vl.py)
_register("Lfm2VlForConditionalGeneration", "mmkit.models.lfm2_vl:Lfm2VlForConditionalGeneration",
          processor="mmkit.processors.lfm2_vl:Lfm2VlInputProcessor", model_types=("lfm2_vl",))
del _register
