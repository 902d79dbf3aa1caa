"""Pydantic v2 models of the OpenAI request and response bodies mmkit serves.

Requests ignore unknown fields, as OpenAI's server does; vLLM's extra sampling fields
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, ...) are accepted in
the body (the OpenAI client sends them through `extra_body`). Types are checked here;
value ranges are checked by `SamplingParams`, so both paths give the same messages.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`, OpenAI's error body."""

    error: ErrorInfo


# ---------------------------------------------------------------------- shared request parts
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequestFields(BaseModel):
    """Fields both endpoints share (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extra body fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    # Structured outputs: accepted here, turned into engine parameters by
    # serving_engine.structured_outputs_from_request.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None  # vLLM's older names
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


# ---------------------------------------------------------------------- chat
class ChatCompletionRequest(SamplingRequestFields):
    """Body of `POST /v1/chat/completions`.

    `messages` stay plain dicts here: mmkit.entrypoints.chat_utils validates them with messages that name the
    offending `messages[i].content[j]`, the same checks `LLM.chat` runs.
    """

    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template: Optional[str] = None
    add_generation_prompt: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class _AlwaysSendObject(BaseModel):
    """Streams are dumped with `exclude_unset` (a delta holds only what changed); `object`
    must be sent all the same."""

    def model_post_init(self, context: Any) -> None:
        self.__pydantic_fields_set__.add("object")


class ChatCompletionChunk(_AlwaysSendObject):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------- completions
class CompletionRequest(SamplingRequestFields):
    """Body of `POST /v1/completions`: `prompt` is a string, a list of strings, a list of
    token ids or a list of token-id lists."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    logprobs: Optional[int] = None
    echo: bool = False


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_AlwaysSendObject):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------- models
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mmkit"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------- tokenization (vLLM's)
class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a `prompt`, or chat `messages` rendered as for a chat request."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------- responses (stateless)
class ResponsesRequest(SamplingRequestFields):
    """Body of `POST /v1/responses`.

    `input` is a string or a list of message items; they stay plain dicts here, checked by
    serving_responses with messages that name `input[i].content[j]`. mmkit keeps no responses,
    so `previous_response_id` and `conversation` are refused there (400), and `store` is ignored.
    """

    input: Optional[Union[str, list[Any]]] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    text: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    n: Literal[1] = 1  # one answer per response


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """OpenAI's response object (its fields a client reads; tools are never used here)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    model: str
    output: list[ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    store: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, Any] = Field(default_factory=dict)
    usage: Optional[ResponseUsage] = None
