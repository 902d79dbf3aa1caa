"""`POST /v1/chat/completions`: OpenAI chat messages (text and `image_url` parts; tool calls and
tool results, images in them too) rendered with the checkpoint's chat template exactly as
`LLM.chat` renders them, answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from mmkit.entrypoints.chat_utils import conversations_to_inputs
from mmkit.entrypoints.openai.errors import OpenAIError, bad_request
from mmkit.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse,
                                               ChatCompletionStreamChoice, ChatMessage, ChatTokenLogprob,
                                               DeltaMessage, TopLogprob, now, random_id)
from mmkit.entrypoints.openai.serving_engine import (MAX_TOP_LOGPROBS, OpenAIServing,
                                                    RequestTimer, request_error,
                                                    finish_reason as _finish_reason, finite as _finite)
from mmkit.entrypoints.openai.streaming import StreamState, sse, sse_done, sse_error
from mmkit.outputs import CompletionOutput, PositionLogprobs, RequestOutput

# Roles OpenAI clients send that the chat templates know under another name.
_ROLE_ALIASES = {"developer": "system"}


class OpenAIServingChat(OpenAIServing):
    """Turns one chat request into one engine request (with `n` sequences)."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Any = None):
        lora = self.check_model(request.model)
        timer = RequestTimer(self.metrics)
        top_logprobs = self._logprobs_k(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        params = self.sampling_params(request, max_tokens, top_logprobs)
        # Images are decoded (and maybe downloaded) off the event loop.
        inputs = await asyncio.to_thread(self._render, request)
        request_id = random_id("chatcmpl")
        first, stream = await self.start(inputs, params, request_id, param="messages", lora_request=lora)
        timer.on_output(first)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(self._stream(request_id, request, first, stream, timer, include_usage,
                                                  top_logprobs),
                                     media_type="text/event-stream")
        final = await self.whole_answer(raw_request, self.last_output(first, stream, timer), timer)
        choices = [ChatCompletionChoice(
            index=c.index, message=ChatMessage(role="assistant", content=c.text),
            logprobs=self._logprobs(c, 0, len(c.token_ids), top_logprobs) if top_logprobs is not None else None,
            finish_reason=_finish_reason(c)) for c in sorted(final.outputs, key=lambda c: c.index)]
        body = ChatCompletionResponse(id=request_id, created=now(), model=self.config.model_name,
                                      choices=choices, usage=self.usage([final]))
        return JSONResponse(body.model_dump())

    # ------------------------------------------------------------------ request -> prompt
    @staticmethod
    def _logprobs_k(request: ChatCompletionRequest) -> int | None:
        k = request.top_logprobs
        if k is not None and not (0 <= k <= MAX_TOP_LOGPROBS):
            raise OpenAIError(f"top_logprobs: got {k}; expected 0 <= top_logprobs <= {MAX_TOP_LOGPROBS}",
                              param="top_logprobs")
        if not request.logprobs:
            if k:
                raise OpenAIError("top_logprobs: got a value but logprobs is false; set logprobs to true",
                                  param="top_logprobs")
            return None
        return k or 0

    def _render(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Messages -> one `generate` input (prompt text + images), as `LLM.chat` builds it."""
        messages = [self._load_images(m, message) for m, message in enumerate(request.messages)]
        processor = self.engine.engine.chat_processor()
        try:
            return conversations_to_inputs(processor, messages, self.config.chat_template,
                                           request.add_generation_prompt)[0]
        except (ValueError, TypeError) as exc:
            # mmkit.entrypoints.chat_utils names parts of a list of conversations; a request holds one.
            message = str(exc).replace("messages[0][", "messages[").replace("messages[0]:", "messages:")
            raise bad_request(type(exc)(message)) from exc
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception (say, roles out of order)
            if type(exc).__module__.startswith("jinja2"):
                raise OpenAIError(f"messages: the chat template rejected them: {exc}", param="messages") from exc
            raise

    def _load_images(self, m: int, message: Any) -> Any:
        """Each `image_url` part -> a decoded image, under the server's media policy."""
        if not isinstance(message, dict):
            return message
        message = dict(message)
        message["role"] = _ROLE_ALIASES.get(message.get("role"), message.get("role"))
        if message.get("content") is None and message.get("role") == "assistant" and not message.get("tool_calls"):
            message["content"] = ""  # OpenAI allows an assistant turn without content
        content = message.get("content")
        if not isinstance(content, list):
            return message
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else None
                where = f"messages[{m}].content[{p}]"
                if not isinstance(url, str):
                    # NOTE: a bare string is refused as OpenAI's API and vLLM refuse it: the field
                    # is an object, and the message shows that form.
                    raise OpenAIError(f"{where}.image_url: got {spec!r:.80}; expected an object "
                                      "{\"url\": \"data:image/...;base64,...\"} (the URL goes in its \"url\" field)",
                                      param=where)
                try:
                    part = {"type": "image", "image": self.config.media.load(url, where)}
                except (ValueError, TypeError) as exc:
                    raise bad_request(exc, param=where) from exc
            parts.append(part)
        message["content"] = parts
        return message

    # ------------------------------------------------------------------ outputs
    def _logprobs(self, c: CompletionOutput, start: int, end: int, k: int) -> ChatChoiceLogprobs:
        entries = []
        for token_id, position in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            entries.append(_token_logprob(token_id, position, k))
        return ChatChoiceLogprobs(content=entries)

    async def _stream(self, request_id: str, request: ChatCompletionRequest, first: RequestOutput,
                      stream: AsyncIterator[RequestOutput], timer: RequestTimer, include_usage: bool,
                      top_logprobs: int | None) -> AsyncIterator[str]:
        created, model = now(), self.config.model_name
        usage_field = {"usage": None} if include_usage else {}

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                           **usage_field))

        state = StreamState(request.n)
        status = "ok"
        try:
            # The role goes in each choice's first delta, and only there.
            for i in range(request.n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                       finish_reason=None))
            out = first
            while True:
                for c in out.outputs:
                    update = state.advance(c)
                    if update is None:
                        continue
                    text, start, end = update
                    choice = ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=text),
                                                        finish_reason=_finish_reason(c))
                    if top_logprobs is not None:
                        choice.logprobs = self._logprobs(c, start, end, top_logprobs)
                    yield chunk(choice)
                if out.finished:
                    break
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    status = "aborted"
                    yield sse_error(OpenAIError("the request was aborted: the server is shutting down", 503))
                    break
                timer.on_output(out)
            if include_usage and status == "ok":
                yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                              usage=self.usage([out])))
            yield sse_done()
        except asyncio.CancelledError:
            status = "disconnected"  # the client went away; leaving `stream` aborts the request
            raise
        except Exception as exc:  # noqa: BLE001 - the stream says why it ends, then ends properly
            status = "error"
            yield sse_error(request_error(exc))
            yield sse_done()
        finally:
            timer.finish(status)
            await stream.aclose()


def _token_logprob(token_id: int, position: PositionLogprobs, k: int) -> ChatTokenLogprob:
    sampled = position[token_id]
    ranked = sorted((lp for lp in position.items() if lp[1].rank is not None and lp[1].rank <= k),
                    key=lambda item: item[1].rank)
    top = [_top(tid, lp) for tid, lp in ranked[:k]]
    token = sampled.decoded_token or ""
    return ChatTokenLogprob(token=token, logprob=_finite(sampled.logprob), bytes=list(token.encode()),
                            top_logprobs=top)


def _top(token_id: int, lp) -> TopLogprob:
    token = lp.decoded_token or ""
    return TopLogprob(token=token, logprob=_finite(lp.logprob), bytes=list(token.encode()))

