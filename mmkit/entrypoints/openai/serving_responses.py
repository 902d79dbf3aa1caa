"""`POST /v1/responses`: OpenAI's Responses API, stateless.

`instructions` (a system message first) and `input` (a string, or message items whose content
holds `input_text` / `input_image` parts) become one chat conversation, rendered with the
checkpoint's chat template exactly as `/v1/chat/completions` and `LLM.chat` render it.
`text.format` is turned into the chat endpoint's `response_format` (mmkit's structured outputs).
The answer is one `message` output item, whole or streamed as OpenAI's typed events
(`response.created` ... `response.completed`). Nothing is stored: `previous_response_id` and
`conversation` are a 400.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from mmkit.entrypoints.chat_utils import conversations_to_inputs
from mmkit.entrypoints.openai.errors import OpenAIError, bad_request
from mmkit.entrypoints.openai.protocol import (IncompleteDetails, ResponseObject, ResponseOutputMessage,
                                               ResponseOutputText, ResponsesRequest, ResponseUsage, now)
from mmkit.entrypoints.openai.serving_engine import (OpenAIServing, RequestTimer,
                                                    request_error)
from mmkit.entrypoints.openai.streaming import StreamState
from mmkit.outputs import RequestOutput
from mmkit.sampling_params import SamplingParams

# Input roles -> the roles chat templates know.
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# `output_text`: an earlier answer sent back as history.
_TEXT_PARTS = ("input_text", "output_text")


def new_id(prefix: str) -> str:
    """OpenAI's id style for responses and items: `resp_<hex>`, `msg_<hex>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses(OpenAIServing):
    """Turns one Responses request into one engine request (one answer)."""

    async def create_response(self, request: ResponsesRequest, raw_request: Any = None):
        lora = self.check_model(request.model)
        _check_stateless(request)
        timer = RequestTimer(self.metrics)
        params = self._sampling_params(request)
        # Images are decoded (and maybe downloaded) off the event loop.
        inputs = await asyncio.to_thread(self._render, request)
        response_id = new_id("resp")
        first, stream = await self.start(inputs, params, response_id, param="input", lora_request=lora)
        timer.on_output(first)
        shell = self._shell(request, params, response_id)
        if request.stream:
            return StreamingResponse(self._stream(shell, first, stream, timer), media_type="text/event-stream")
        final = await self.whole_answer(raw_request, self.last_output(first, stream, timer), timer)
        return JSONResponse(_finished(shell, final, new_id("msg")).model_dump())

    # ------------------------------------------------------------------ request -> engine input
    def _sampling_params(self, request: ResponsesRequest) -> SamplingParams:
        response_format = _response_format(request.text)
        if response_format is not None:
            request = request.model_copy(update={"response_format": response_format})
        max_tokens = request.max_output_tokens if request.max_output_tokens is not None else request.max_tokens
        try:
            return self.sampling_params(request, max_tokens, None)
        except OpenAIError as exc:
            # Name the Responses API's fields, not the chat names they were mapped to.
            if response_format is not None and (exc.param or "").startswith("response_format"):
                exc.message, exc.param = _text_format_names(exc.message), _text_format_names(exc.param)
            elif exc.param == "max_tokens" and request.max_output_tokens is not None:
                exc.message = re.sub(r"^max_tokens\b", "max_output_tokens", exc.message)
                exc.param = "max_output_tokens"
            raise

    def _render(self, request: ResponsesRequest) -> dict[str, Any]:
        """`instructions` + `input` -> one `generate` input (prompt text + images), as `LLM.chat` builds it."""
        messages = self._messages(request)
        processor = self.engine.engine.chat_processor()
        try:
            return conversations_to_inputs(processor, messages, self.config.chat_template, True)[0]
        except (ValueError, TypeError) as exc:
            raise bad_request(exc, param="input") from exc
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception (say, roles out of order)
            if type(exc).__module__.startswith("jinja2"):
                raise OpenAIError(f"input: the chat template rejected the messages: {exc}", param="input") from exc
            raise

    def _messages(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        items = request.input
        if items is None:
            raise OpenAIError("input: missing; expected a string or a list of input messages", param="input")
        if isinstance(items, list) and not items:
            raise OpenAIError("input: got an empty list; expected at least one input message", param="input")
        messages = [] if request.instructions is None else [{"role": "system", "content": request.instructions}]
        if isinstance(items, str):
            return messages + [{"role": "user", "content": items}]
        return messages + [self._message(f"input[{i}]", item) for i, item in enumerate(items)]

    def _message(self, where: str, item: Any) -> dict[str, Any]:
        if not isinstance(item, dict):
            raise OpenAIError(f"{where}: got {item!r:.80}; expected a message object "
                              "{\"role\": ..., \"content\": ...}", param=where)
        kind = item.get("type", "message")
        if kind != "message":
            raise OpenAIError(f"{where}.type: got {kind!r}; expected 'message' (this server takes no tool or "
                              "reasoning items)", param=f"{where}.type")
        role = item.get("role")
        if role not in _ROLES:
            raise OpenAIError(f"{where}.role: got {role!r}; expected one of {list(_ROLES)}", param=f"{where}.role")
        content = item.get("content")
        if isinstance(content, str):
            return {"role": _ROLES[role], "content": content}
        if not isinstance(content, list):
            raise OpenAIError(f"{where}.content: got {type(content).__name__}; expected a string or a list of "
                              "input_text / input_image parts", param=f"{where}.content")
        parts = [self._part(f"{where}.content[{j}]", part) for j, part in enumerate(content)]
        return {"role": _ROLES[role], "content": parts}

    def _part(self, where: str, part: Any) -> dict[str, Any]:
        """One content part -> chat_utils' form; an `input_image` is decoded here, under the media policy."""
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(f"{where}.text: got {type(text).__name__}; expected a string", param=f"{where}.text")
            return {"type": "text", "text": text}
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                hint = "; file_id is not supported" if part.get("file_id") is not None else ""
                raise OpenAIError(f"{where}.image_url: got {url!r:.80}; expected a string: an image URL or a "
                                  f"data:image/...;base64 URI{hint}", param=f"{where}.image_url")
            try:
                return {"type": "image", "image": self.config.media.load(url, where)}
            except (ValueError, TypeError) as exc:
                raise bad_request(exc, param=where) from exc
        shown = repr(kind) if isinstance(part, dict) else f"{part!r:.80}"
        raise OpenAIError(f"{where}.type: got {shown}; expected 'input_text' or 'input_image'", param=f"{where}.type")

    # ------------------------------------------------------------------ outputs
    def _shell(self, request: ResponsesRequest, params: SamplingParams, response_id: str) -> ResponseObject:
        """The response as it stands before any output: what `response.created` carries."""
        fmt = (request.text or {}).get("format") or {"type": "text"}
        return ResponseObject(id=response_id, created_at=now(), status="in_progress", model=self.config.model_name,
                              instructions=request.instructions, temperature=params.temperature,
                              top_p=params.top_p, max_output_tokens=request.max_output_tokens,
                              text={"format": fmt})

    async def _stream(self, shell: ResponseObject, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                      timer: RequestTimer) -> AsyncIterator[str]:
        event = _event_writer()
        message_id = new_id("msg")
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        status = "ok"
        try:
            yield event("response.created", response=shell.model_dump())
            yield event("response.in_progress", response=shell.model_dump())
            yield event("response.output_item.added", output_index=0,
                        item=ResponseOutputMessage(id=message_id, status="in_progress").model_dump())
            yield event("response.content_part.added", **where, part=ResponseOutputText(text="").model_dump())
            state = StreamState(1)
            out = first
            while True:
                update = state.advance(out.outputs[0])
                if update is not None and update[0]:
                    yield event("response.output_text.delta", **where, delta=update[0], logprobs=[])
                if out.finished:
                    break
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    status = "aborted"
                    for chunk in _failed(event, shell, OpenAIError("the request was aborted: the server is "
                                                                  "shutting down", 503)):
                        yield chunk
                    return
                timer.on_output(out)
            final = _finished(shell, out, message_id)
            message = final.output[0]
            part = message.content[0]
            yield event("response.output_text.done", **where, text=part.text, logprobs=[])
            yield event("response.content_part.done", **where, part=part.model_dump())
            yield event("response.output_item.done", output_index=0, item=message.model_dump())
            done = "response.completed" if final.status == "completed" else "response.incomplete"
            yield event(done, response=final.model_dump())
        except asyncio.CancelledError:
            status = "disconnected"  # the client went away; leaving `stream` aborts the request
            raise
        except Exception as exc:  # noqa: BLE001 - the stream says why it ends, then ends properly
            status = "error"
            for chunk in _failed(event, shell, request_error(exc)):
                yield chunk
        finally:
            timer.finish(status)
            await stream.aclose()


def _check_stateless(request: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation"):
        if getattr(request, name) is not None:
            raise OpenAIError(f"{name}: mmkit serve keeps no responses or conversations (stateless); send the "
                              "whole conversation in `input` instead", param=name)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> the chat endpoint's `response_format`; None for free text."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError(f"text.format: got {fmt!r:.80}; expected an object such as {{\"type\": \"json_schema\", "
                          "\"name\": ..., \"schema\": {...}}", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise OpenAIError(f"text.format.type: got {kind!r}; expected 'text', 'json_schema' or 'json_object'",
                          param="text.format.type")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"text.format.name: got {name!r}; expected a non-empty string", param="text.format.name")
    if not isinstance(schema, dict):
        raise OpenAIError(f"text.format.schema: got {schema!r:.80}; expected a JSON schema object",
                          param="text.format.schema")
    spec = {"name": name, "schema": schema, **({"strict": fmt["strict"]} if "strict" in fmt else {})}
    return {"type": "json_schema", "json_schema": spec}


def _text_format_names(text: str | None) -> str | None:
    if text is None:
        return None
    return text.replace("response_format.json_schema", "text.format").replace("response_format", "text.format")


def _finished(shell: ResponseObject, final: RequestOutput, message_id: str) -> ResponseObject:
    """The whole response from the request's final output."""
    c = final.outputs[0]
    incomplete = c.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    message = ResponseOutputMessage(id=message_id, status=status, content=[ResponseOutputText(text=c.text)])
    num_input, num_output = len(final.prompt_token_ids), len(c.token_ids)
    usage = ResponseUsage(input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output)
    details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
    return shell.model_copy(update={"status": status, "incomplete_details": details, "output": [message],
                                    "usage": usage})


def _event_writer() -> Callable[..., str]:
    """`event(type, **fields)` -> one SSE event (`event:` + `data:` lines), numbered in order."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    return event


def _failed(event: Callable[..., str], shell: ResponseObject, error: OpenAIError) -> list[str]:
    """OpenAI's end of a failed stream: an `error` event, then `response.failed`."""
    failed = shell.model_copy(update={"status": "failed", "error": {"code": error.code or error.type,
                                                                    "message": error.message}})
    return [event("error", code=error.code or error.type, message=error.message, param=error.param),
            event("response.failed", response=failed.model_dump())]
