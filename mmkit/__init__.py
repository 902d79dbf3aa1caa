"""mmkit: offline inference for LLaVA-style vision-language models on a paged KV cache."""

from mmkit.config import EngineArgs
from mmkit.engine.async_engine import AsyncLLMEngine
from mmkit.engine.llm_engine import LLMEngine
from mmkit.errors import EngineDeadError
from mmkit.inputs import MultiModalData, PromptInputs, TextPrompt, TokensPrompt
from mmkit.llm import LLM
from mmkit.outputs import CompletionOutput, Logprob, RequestOutput
from mmkit.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "MultiModalData",
    "TextPrompt",
    "TokensPrompt",
    "PromptInputs",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineDeadError",
]
__version__ = "0.1.0"
