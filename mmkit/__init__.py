"""mmkit: offline inference for LLaVA-style vision-language models on a paged KV cache.

Names are imported lazily, so `import mmkit` (and the `mmkit` command) can set up the
environment before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "mmkit.llm",
    "SamplingParams": "mmkit.sampling_params",
    "StructuredOutputsParams": "mmkit.sampling_params",
    "MultiModalData": "mmkit.inputs",
    "TextPrompt": "mmkit.inputs",
    "TokensPrompt": "mmkit.inputs",
    "PromptInputs": "mmkit.inputs",
    "RequestOutput": "mmkit.outputs",
    "CompletionOutput": "mmkit.outputs",
    "Logprob": "mmkit.outputs",
    "EngineArgs": "mmkit.config",
    "LLMEngine": "mmkit.engine.llm_engine",
    "AsyncLLMEngine": "mmkit.engine.async_engine",
    "EngineDeadError": "mmkit.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # pragma: no cover
    from mmkit.config import EngineArgs
    from mmkit.engine.async_engine import AsyncLLMEngine
    from mmkit.engine.llm_engine import LLMEngine
    from mmkit.errors import EngineDeadError
    from mmkit.inputs import MultiModalData, PromptInputs, TextPrompt, TokensPrompt
    from mmkit.llm import LLM
    from mmkit.outputs import CompletionOutput, Logprob, RequestOutput
    from mmkit.sampling_params import SamplingParams, StructuredOutputsParams
