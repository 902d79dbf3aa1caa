"""vLLM's `POST /tokenize` and `POST /detokenize`: the token ids the engine would see (image
placeholders expanded to the model's image tokens), and text back from ids."""

from __future__ import annotations

import asyncio

from mmkit.entrypoints.openai.errors import OpenAIError, bad_request
from mmkit.entrypoints.openai.protocol import (ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                               TokenizeRequest, TokenizeResponse)
from mmkit.entrypoints.openai.serving_chat import OpenAIServingChat
from mmkit.multimodal.parse import parse_prompt


class OpenAIServingTokenization(OpenAIServingChat):
    """Shares the chat handler's rendering, so counts match what a chat request uses."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("prompt, messages: expected exactly one of them", param="prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(messages=request.messages,
                                         add_generation_prompt=request.add_generation_prompt)
            inputs = await asyncio.to_thread(self._render, chat)
        else:
            inputs = {"prompt": request.prompt}
        try:
            processed = self.engine.engine.process_inputs(parse_prompt(0, inputs))
        except (ValueError, TypeError) as exc:
            raise bad_request(type(exc)(str(exc).replace("inputs[0]", "prompt"))) from exc
        ids = list(processed.prompt_token_ids)
        return TokenizeResponse(count=len(ids), max_model_len=self.config.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab_size = self.engine.engine.config.model.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"tokens: got token id {bad[0]}; expected ids in [0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
