"""What the chat and completion handlers share: the served model's names, request ->
`SamplingParams`, starting a request on the `AsyncLLMEngine` so that bad input is a 400
before any byte of a stream is sent, and the request metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar

from mmkit.engine.async_engine import AsyncLLMEngine
from mmkit.entrypoints.openai.errors import OpenAIError, bad_request
from mmkit.entrypoints.openai.media import MediaPolicy
from mmkit.entrypoints.openai.metrics import ServerMetrics
from mmkit.entrypoints.openai.protocol import UsageInfo, SamplingRequestFields
from mmkit.errors import EngineDeadError
from mmkit.outputs import CompletionOutput, RequestOutput
from mmkit.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("mmkit.serve")

#: The largest `top_logprobs` / completions `logprobs` accepted (OpenAI's limits).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


@dataclass(frozen=True)
class ServerConfig:
    """Everything the handlers need besides the engine; built once from the command line."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    media: MediaPolicy = field(default_factory=MediaPolicy)
    chat_template: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no cross-origin browser calls
    # Sampling defaults for fields a request leaves unset (the checkpoint's generation_config.json,
    # as `vllm serve --generation-config auto` does), e.g. {"temperature": 0.7}.
    default_sampling: Mapping[str, Any] = field(default_factory=dict)
    # LoRA adapters served by name (mmkit/entrypoints/openai/serving_lora.py), None without LoRA.
    lora: Any = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def structured_outputs_from_request(request: SamplingRequestFields) -> Any:
    """`response_format` / `structured_outputs` / vLLM's `guided_*` -> the engine's
    `StructuredOutputsParams`, or None for free text.

    NOTE: the one place that knows about structured outputs. Where the engine has no
    structured outputs (mmkit.structured_outputs absent), any constraint is a clear 400
    rather than output that silently ignores it.
    """
    guided = {name: getattr(request, name) for name in _GUIDED_FIELDS if getattr(request, name) is not None}
    fmt = request.response_format
    constrained = bool(request.structured_outputs) or bool(guided) or (
        fmt is not None and fmt.get("type", "text") != "text")
    try:
        from mmkit.structured_outputs.openai import structured_outputs_from_openai
    except ImportError:
        if constrained:
            param = "response_format" if fmt is not None else "structured_outputs" if \
                request.structured_outputs else next(iter(guided))
            raise OpenAIError(f"{param}: structured outputs are not supported yet by this server", 400,
                              param=param) from None
        return None
    try:
        return structured_outputs_from_openai(fmt, request.structured_outputs, **guided)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from exc


_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_from(folder: str | None) -> dict[str, Any]:
    """The sampling fields a checkpoint's generation_config.json sets explicitly, in
    `SamplingParams` names ({} when there is none or `folder` is None)."""
    if folder is None:
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    except OSError:  # no generation_config.json
        return {}
    return {ours: diff[theirs] for theirs, ours in _GENERATION_CONFIG_KEYS.items() if diff.get(theirs) is not None}


class OpenAIServing:
    """Base of the chat and completion handlers."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, model: str | None) -> Any:
        """The `LoRARequest` a model name selects (None: the base model); 404 for an unknown name."""
        if model is not None and model not in self.config.served_model_names:
            lora = self.config.lora.get(model) if self.config.lora is not None else None
            if lora is not None:
                return lora
            served = list(self.config.served_model_names) + (self.config.lora.names() if self.config.lora else [])
            raise OpenAIError(f"The model `{model}` does not exist. Served: {served}",
                              404, param="model", code="model_not_found")
        return None

    def sampling_params(self, request: SamplingRequestFields, max_tokens: int | None, logprobs: int | None
                        ) -> SamplingParams:
        """The request's fields -> `SamplingParams` (whose checks give the 400 messages)."""
        structured = structured_outputs_from_request(request)
        values: dict[str, Any] = dict(
            n=request.n, presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output, ignore_eos=request.ignore_eos,
            max_tokens=max_tokens, min_tokens=request.min_tokens, logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
        )
        # Unset fields: the checkpoint's generation config, else SamplingParams' (vLLM's) defaults.
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(request, name)
            if value is None:
                value = self.config.default_sampling.get(name)
            if value is not None:
                values[name] = value
        if max_tokens is None and "max_tokens" in self.config.default_sampling:
            values["max_tokens"] = self.config.default_sampling["max_tokens"]
        if structured is not None:
            values["structured_outputs"] = structured
        try:
            return SamplingParams(**values)
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from exc

    async def start(self, inputs: Any, params: SamplingParams, request_id: str, param: str | None = None,
                    lora_request: Any = None) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Add one request and wait for its first output.

        Input checks (prompt too long, too many images, a bad image) raise before or at the
        first output, so they become a 400 before a response (or a stream) has begun. With
        `param`, an error the engine names `inputs[0]...` names that request field instead.
        """
        stream = self.engine.generate(inputs, params, request_id, **(
            {"lora_request": lora_request} if lora_request is not None else {}))
        try:
            first = await stream.__anext__()
        except StopAsyncIteration as exc:  # aborted (shutdown) before the first output
            raise OpenAIError("the request was aborted: the server is shutting down", 503) from exc
        except Exception as exc:  # noqa: BLE001 - each kind has its status in request_error
            error = request_error(exc)
            if param is not None and error.param and error.param.startswith("inputs[0]"):
                error.message, error.param = error.message.replace("inputs[0]", param, 1), param
            raise error from exc
        return first, stream

    @staticmethod
    async def last_output(first: RequestOutput, stream: AsyncIterator[RequestOutput],
                          timer: RequestTimer) -> RequestOutput:
        """Run one request to its end; its final output."""
        final = first
        try:
            async for out in stream:
                timer.on_output(out)
                final = out
        except Exception as exc:  # noqa: BLE001 - each kind has its status in request_error
            raise request_error(exc) from exc
        if not final.finished:
            raise OpenAIError("the request was aborted: the server is shutting down", 503)
        return final

    @staticmethod
    async def until_disconnect(raw_request: Any, coro: Awaitable[T]) -> T:
        """Await `coro` (a whole, non-streamed answer); if the client hangs up first, cancel it,
        which leaves the engine streams and so aborts the requests (streams are watched by
        Starlette itself)."""
        if raw_request is None:  # called from Python, not through the app
            return await coro
        work = asyncio.ensure_future(coro)
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watcher.cancel()
        if not work.done():
            if not watcher.cancelled() and watcher.exception() is not None:
                return await work  # the watcher failed, not the client: keep waiting
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientDisconnected()
        return work.result()

    async def whole_answer(self, raw_request: Any, coro: Awaitable[T], timer: RequestTimer) -> T:
        """`until_disconnect` for a non-streamed answer, with the request's timer finished as
        "ok" or "disconnected" (every endpoint's metrics count both the same way)."""
        try:
            result = await self.until_disconnect(raw_request, coro)
        except ClientDisconnected:
            timer.finish("disconnected")
            raise
        timer.finish("ok")
        return result

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def request_error(exc: BaseException) -> OpenAIError:
    """What a request's failure tells the client: bad input is a 400, a stopped engine a 503,
    anything else (the model failed on this request) a 500 that names the error."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(exc)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"the engine is not running: {exc}", 503, code="engine_dead")
    logger.error("request failed: %r", exc)
    return OpenAIError(f"the request failed in the engine: {type(exc).__name__}: {exc}", 500,
                       code="request_failed")


class ClientDisconnected(Exception):
    """The client went away before its non-streamed answer was ready."""


async def _wait_for_disconnect(raw_request: Any) -> None:
    # NOTE: the body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class RequestTimer:
    """Times of one HTTP request, fed to the metrics: time to first token and time in the
    queue from the engine's own `RequestOutput.metrics` (arrival in the engine -> first token,
    as vLLM counts them); the end-to-end latency from the HTTP request's arrival."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token_seen = False
        self.queue_time_seen = False

    def on_output(self, out: RequestOutput) -> None:
        timings = out.metrics or {}
        arrival = timings.get("arrival_time")
        if not self.queue_time_seen and timings.get("time_in_queue") is not None:
            self.queue_time_seen = True
            self.metrics.request_queue_time.observe(timings["time_in_queue"])
        if self.first_token_seen or not any(c.token_ids for c in out.outputs):
            return
        self.first_token_seen = True
        first = timings.get("first_token_time")
        if arrival is not None and first is not None:
            self.metrics.time_to_first_token.observe(max(first - arrival, 0.0))
        else:  # an engine without timings: measured here, from the HTTP request's arrival
            self.metrics.time_to_first_token.observe(time.perf_counter() - self.arrival)

    def finish(self, status: str) -> None:
        self.metrics.observe_request(time.perf_counter() - self.arrival, status)


def finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI's finish reasons: "stop" (EOS or a stop string/token) or "length"."""
    if c.finish_reason in ("stop", "length"):
        return c.finish_reason
    return None if c.finish_reason is None else "stop"


def finite(value: float) -> float:
    """JSON has no -inf: a filtered-out token's logprob is sent as -9999.0 (vLLM does the same)."""
    return max(float(value), -9999.0) if value == value else -9999.0
