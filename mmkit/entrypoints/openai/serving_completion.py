"""`POST /v1/completions`: one engine request per prompt (a string or token ids); choice
`i * n + j` is sequence j of prompt i, as in OpenAI's and vLLM's servers."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from mmkit.entrypoints.openai.errors import OpenAIError
from mmkit.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                               CompletionResponse, now, random_id)
from mmkit.entrypoints.openai.serving_engine import (MAX_COMPLETION_LOGPROBS, OpenAIServing,
                                                    RequestTimer, request_error,
                                                    finish_reason as _finish_reason, finite as _finite)
from mmkit.entrypoints.openai.streaming import StreamState, sse, sse_done, sse_error
from mmkit.outputs import CompletionOutput, RequestOutput
from mmkit.sampling_params import SamplingParams

_END = object()


def prompts_to_inputs(prompt: Any) -> list[dict[str, Any]]:
    """A string, list of strings, token ids or list of token-id lists -> `generate` inputs."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise OpenAIError("prompt: got an empty list; expected a string, strings, token ids or token-id lists",
                          param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    inputs = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            inputs.append({"prompt": p})
        elif p:
            inputs.append({"prompt_token_ids": list(p)})
        else:
            raise OpenAIError(f"prompt[{i}]: got an empty list; expected token ids", param=f"prompt[{i}]")
    return inputs


class OpenAIServingCompletion(OpenAIServing):
    """Turns one completion request into one engine request per prompt."""

    async def create_completion(self, request: CompletionRequest, raw_request: Any = None):
        lora = self.check_model(request.model)
        timer = RequestTimer(self.metrics)
        k = request.logprobs
        if k is not None and not (0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise OpenAIError(f"logprobs: got {k}; expected 0 <= logprobs <= {MAX_COMPLETION_LOGPROBS}",
                              param="logprobs")
        params = self.sampling_params(request, request.max_tokens, k)
        inputs = prompts_to_inputs(request.prompt)
        request_id = random_id("cmpl")
        started = await self._start_all(inputs, params, request_id, lora)
        echoes = [self._echo_text(o) if request.echo else "" for o, _ in started]
        for first, _ in started:
            timer.on_output(first)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(self._stream(request_id, request, started, echoes, timer, include_usage),
                                     media_type="text/event-stream")
        finals = await self.whole_answer(raw_request, asyncio.gather(
            *(self.last_output(first, stream, timer) for first, stream in started)), timer)
        choices = []
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(CompletionChoice(
                    index=i * request.n + c.index, text=echoes[i] + c.text, finish_reason=_finish_reason(c),
                    logprobs=self._logprobs(c, 0, len(c.token_ids), k, len(echoes[i])) if k is not None else None))
        body = CompletionResponse(id=request_id, created=now(), model=self.config.model_name, choices=choices,
                                  usage=self.usage(finals))
        return JSONResponse(body.model_dump())

    async def _start_all(self, inputs: list[dict], params: SamplingParams, request_id: str, lora_request=None
                         ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """Start one request per prompt, all at once (validated together, prefilled together);
        if any prompt is bad, the others are aborted and the first bad one is the 400."""
        ids = [request_id if len(inputs) == 1 else f"{request_id}-{i}" for i in range(len(inputs))]
        results = await asyncio.gather(*(self.start(item, params, rid, lora_request=lora_request)
                                         for item, rid in zip(inputs, ids)),
                                       return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            return results
        for r in results:
            if not isinstance(r, BaseException):
                await r[1].aclose()  # leaving the stream aborts the request
        i, exc = failed[0]
        if isinstance(exc, OpenAIError):
            name = "prompt" if len(inputs) == 1 else f"prompt[{i}]"
            exc.message = exc.message.replace("inputs[0]", name)
            if exc.param and exc.param.startswith("inputs[0]"):
                exc.param = name
        raise exc

    def _echo_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, c: CompletionOutput, start: int, end: int, k: int, offset: int) -> CompletionLogprobs:
        # Fields set explicitly: streamed chunks are dumped with exclude_unset.
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, position in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            sampled = position[token_id]
            token = sampled.decoded_token or ""
            result.tokens.append(token)
            result.token_logprobs.append(_finite(sampled.logprob))
            ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= k),
                            key=lambda lp: lp.rank)
            result.top_logprobs.append({(lp.decoded_token or ""): _finite(lp.logprob) for lp in ranked[:k]})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    async def _stream(self, request_id: str, request: CompletionRequest,
                      started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]], echoes: list[str],
                      timer: RequestTimer, include_usage: bool) -> AsyncIterator[str]:
        created, model, n, k = now(), self.config.model_name, request.n, request.logprobs
        usage_field = {"usage": None} if include_usage else {}
        prefixes = [echoes[i] for i in range(len(started)) for _ in range(n)]
        state = StreamState(len(started) * n, prefixes)
        offsets = [len(p) for p in prefixes]  # text offset of each choice's next token
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                await queue.put((i, first))
                async for out in stream:
                    await queue.put((i, out))
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                await queue.put((i, exc))
            finally:
                await queue.put((i, _END))

        tasks = [asyncio.create_task(pump(i, first, stream)) for i, (first, stream) in enumerate(started)]
        latest: dict[int, RequestOutput] = {}
        status = "ok"
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                    if status == "ok" and (i not in latest or not latest[i].finished):
                        status = "aborted"
                    continue
                if isinstance(item, BaseException):
                    if status != "error":  # one error event per stream
                        yield sse_error(request_error(item))
                    status = "error"
                    continue
                latest[i] = item
                timer.on_output(item)
                for c in item.outputs:
                    slot = i * n + c.index
                    update = state.advance(c, slot)
                    if update is None:
                        continue
                    text, start, end = update
                    choice = CompletionChoice(index=slot, text=text, finish_reason=_finish_reason(c))
                    if k is not None:
                        choice.logprobs = self._logprobs(c, start, end, k, offsets[slot])
                        offsets[slot] += sum(len(t) for t in choice.logprobs.tokens)
                    yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice],
                                                 **usage_field))
            if status == "aborted":
                yield sse_error(OpenAIError("the request was aborted: the server is shutting down", 503))
            elif include_usage and status == "ok":
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=self.usage([latest[i] for i in sorted(latest)])))
            yield sse_done()
        except asyncio.CancelledError:
            status = "disconnected"
            raise
        finally:
            for task in tasks:
                task.cancel()  # the pumps leave their streams: the engine aborts those requests
            timer.finish(status)

