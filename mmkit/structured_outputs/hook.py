"""Structured outputs as the runner's sampler hook (see mmkit/worker/seq_state.py::SamplerHook).

Each constrained sequence keeps a `StructuredOutputRequest` (its xgrammar matcher) in the
runner's per-sequence cache, `state.sampler_state["structured_outputs"]`; it survives the
runner's rebuilds of that cache (preemption by recompute, a failed step).
"""

from __future__ import annotations

import logging

import torch

from mmkit.structured_outputs.backend import StructuredOutputBackend
from mmkit.structured_outputs.bitmask import GrammarBitmask
from mmkit.structured_outputs.request import StructuredOutputRequest

logger = logging.getLogger(__name__)
KEY = "structured_outputs"


class StructuredOutputHook:
    """Masks constrained rows before sampling and advances their matchers after it.

    - `on_new_seq`: a fresh matcher (the compiled grammar comes from the engine's cache); each
      of an n > 1 request's samples is a request of its own, with its own matcher.
    - `apply`: one bitmask fill for every active matcher of the step, applied in place
      (logits [rows, vocab], any float dtype); a matcher that accepted EOS (the sequence
      goes on only under `ignore_eos`) allows EOS alone. A matcher out of step with its
      sequence's tokens is rebuilt from them, so no runner policy can desynchronise it.
    - `on_sampled`: feed the kept token to the matcher.
    """

    def __init__(self, backend: StructuredOutputBackend) -> None:
        self.backend = backend
        self.bitmask = GrammarBitmask()
        self.stop_token_ids = list(backend.tokenizer_info.stop_token_ids)

    def on_new_seq(self, state) -> None:
        params = state.params.structured_outputs
        if params is None:
            return
        state.sampler_state[KEY] = self.backend.new_request(params)

    def apply(self, logits: torch.Tensor, states: list) -> None:
        indices: list[int] = []
        matchers: list = []
        terminated: list[int] = []
        for i, state in enumerate(states):
            request: StructuredOutputRequest | None = state.sampler_state.get(KEY)
            if request is None:
                continue
            if request.num_tokens != state.num_output_tokens:
                request = state.sampler_state[KEY] = request.rebuild(state.token_ids[state.num_prompt_tokens:])
            if request.is_terminated():
                terminated.append(i)
            else:
                indices.append(i)
                matchers.append(request.matcher)
        self.bitmask.apply(logits, matchers, indices)
        if terminated:
            rows = torch.tensor(terminated, device=logits.device)
            eos = logits[rows][:, self.stop_token_ids]
            logits[rows] = float("-inf")
            logits[rows[:, None], torch.tensor(self.stop_token_ids, device=logits.device)] = eos

    def on_sampled(self, state, token_id: int) -> None:
        request: StructuredOutputRequest | None = state.sampler_state.get(KEY)
        if request is not None and not request.accept(token_id) and not request.is_terminated():
            # Only a NaN row can defeat the mask; the sequence goes on unconstrained-safe:
            # the next apply() rebuilds the matcher from the tokens (and stops at this one).
            logger.warning("request %r: token %d is outside its grammar", state.request_id, token_id)
