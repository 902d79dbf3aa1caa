"""mmkit: offline inference for LLaVA-style vision-language models on a paged KV cache.

Names are imported lazily, so `import mmkit` (and the `mmkit` command) can set up the
environment before torch is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

# NOTE: OpenMP reads these once, when torch loads it: set here only if torch is not loaded
# yet, and never over the user's own values. PASSIVE: idle OpenMP threads sleep instead of
# spinning (spinning makes small or shared CPUs 20-100x slower). PASSIVE alone makes every
# parallel region wake a sleeping thread (~80 us measured; a decode step has hundreds of
# regions): a short bounded spin first (GNU OpenMP's GOMP_SPINCOUNT) halves batch-1 decode
# time without the collapse.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "mmkit.entrypoints.llm",
    "SamplingParams": "mmkit.sampling_params",
    "StructuredOutputsParams": "mmkit.sampling_params",
    "MultiModalData": "mmkit.multimodal.parse",
    "TextPrompt": "mmkit.multimodal.parse",
    "TokensPrompt": "mmkit.multimodal.parse",
    "PromptInputs": "mmkit.multimodal.parse",
    "RequestOutput": "mmkit.outputs",
    "CompletionOutput": "mmkit.outputs",
    "Logprob": "mmkit.outputs",
    "EngineArgs": "mmkit.config",
    "LLMEngine": "mmkit.engine.llm_engine",
    "AsyncLLMEngine": "mmkit.engine.async_engine",
    "EngineDeadError": "mmkit.errors",
    "RequestFailedError": "mmkit.errors",
    "ModelRegistry": "mmkit.models.registry",
    "BeamSearchParams": "mmkit.entrypoints.beam_search",
    "BeamSearchOutput": "mmkit.entrypoints.beam_search",
    "BeamSearchSequence": "mmkit.entrypoints.beam_search",
    "LoRARequest": "mmkit.lora.request",
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
    from mmkit.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from mmkit.config import EngineArgs
    from mmkit.engine.async_engine import AsyncLLMEngine
    from mmkit.engine.llm_engine import LLMEngine
    from mmkit.errors import EngineDeadError, RequestFailedError
    from mmkit.multimodal.parse import MultiModalData, PromptInputs, TextPrompt, TokensPrompt
    from mmkit.entrypoints.llm import LLM
    from mmkit.models.registry import ModelRegistry
    from mmkit.outputs import CompletionOutput, Logprob, RequestOutput
    from mmkit.sampling_params import SamplingParams, StructuredOutputsParams
