"""OutputProcessor: the one owner of what a request returns.

Per request it keeps the text of each sample (incremental detokenization), logprobs, stop
reasons, prompt logprobs and timing metrics; it appends each sampled token, decides stops
(EOS, stop token ids, stop strings, max_tokens, max_model_len) and builds `RequestOutput`s.
The scheduler owns token counters and blocks and is told which sequences stop.

A request with n > 1 samples reaches the scheduler as n child requests (vLLM v1's
`ParentRequest`, engine/parent_request.py); here they are one `RequestState` again: child i
fills sample i, and the request is finished when every child is. The request-level counters
of `get_metrics()` are counted here, per user request (`stats`).

Outputs: a streaming request (AsyncLLMEngine) gets one per step it progresses; a request
added with `final_only=True` (LLM.generate, evaluation) gets exactly one, when it finishes,
so no per-token O(length) copies of ids and text are made for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mmkit.engine import detokenizer
from mmkit.engine.sequence import SequenceStatus, TokenCounts
from mmkit.layers.sampler import SamplerOutput
from mmkit.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from mmkit.sampling_params import SamplingParams


@dataclass(eq=False)
class SeqOutputState(TokenCounts):
    """One sample's output side: its tokens (after the prompt), text and logprobs.

    `token_ids` holds the prompt then the outputs (the detokenizer reads the outputs only);
    the list is the output processor's own."""

    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    output_text: str = ""
    prefix_offset: int = 0  # detokenizer window, relative to the first output token
    read_offset: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    finish_reason: str | None = None


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    final_only: bool
    child_ids: tuple[str, ...]  # the scheduler request of each sample, by index
    seqs: dict[int, SeqOutputState] = field(default_factory=dict)  # sample index -> state
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # No text is seen before the request finishes and no stop string needs it: skip the
    # per-token incremental decode; every finish path decodes the full text once (`flush`).
    text_at_finish_only: bool = False

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finish_reason is not None for s in self.seqs.values())


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}  # by the user's request id
        self._children: dict[str, tuple[RequestState, int]] = {}  # scheduler request id -> (state, sample)
        self.num_outputs_built = 0  # RequestOutput objects made (a test counts them)
        # Per user request (the children of an n > 1 request count once): requests finished
        # (not aborted), prompt tokens (at the first token), generated tokens.
        self.stats = {"num_requests_finished": 0, "prompt_tokens": 0, "generation_tokens": 0}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, final_only: bool, child_ids: list[str]) -> None:
        """A user request whose sample i is computed by scheduler request `child_ids[i]`."""
        state = RequestState(request_id, prompt, prompt_token_ids, params, final_only, tuple(child_ids),
                             text_at_finish_only=final_only and not params.stop)
        for index, child_id in enumerate(child_ids):
            state.seqs[index] = SeqOutputState(index, list(prompt_token_ids), len(prompt_token_ids))
            self._children[child_id] = (state, index)
        self.requests[request_id] = state

    def parent_id(self, child_id: str) -> str | None:
        """The user request a scheduler request belongs to (None once it is forgotten)."""
        entry = self._children.get(child_id)
        return entry[0].request_id if entry is not None else None

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._forget_children(state)

    def _forget_children(self, state: RequestState) -> None:
        for child_id in state.child_ids:
            self._children.pop(child_id, None)

    def record_scheduled(self, child_id: str, now: float) -> None:
        entry = self._children.get(child_id)
        if entry is not None and entry[0].first_scheduled_time is None:
            entry[0].first_scheduled_time = now

    # ------------------------------------------------------------------ per token
    def process_sample(self, child_id: str, out: SamplerOutput, row: int, now: float) -> SequenceStatus | None:
        """Append the sampled token of row `row` to the sample scheduler request `child_id`
        computes; return its stop status."""
        state, index = self._children[child_id]
        seq = state.seqs[index]
        self.stats["generation_tokens"] += 1
        if state.first_token_time is None:
            state.first_token_time = now
            self.stats["prompt_tokens"] += len(state.prompt_token_ids)
        state.last_token_time = now
        params = state.params
        token = out.token_ids[row]
        seq.token_ids.append(token)
        if out.logprobs is not None:  # computed only in steps where some request asks for logprobs
            seq.cumulative_logprob += out.logprobs[row]
        if params.logprobs is not None:
            seq.logprobs.append(token_logprobs(
                self.tokenizer, token, out.logprobs[row], out.ranks[row] if out.ranks else None,
                out.top_ids[row] if out.top_ids else None,
                out.top_logprobs[row] if out.top_logprobs else None, params.logprobs))
        new_chars = 0 if state.text_at_finish_only else len(
            detokenizer.decode_incrementally(self.tokenizer, seq, params))
        status = check_stop(seq, params, self.tokenizer, self.max_model_len, new_chars)
        if status is not None:
            seq.finish_reason = status.value
        return status

    def finish_seq(self, child_id: str, status: SequenceStatus) -> None:
        """A stop decided elsewhere (out of KV cache) for scheduler request `child_id`."""
        entry = self._children.get(child_id)
        if entry is not None:
            self._finish_sample(entry[0], entry[1], status)

    def _finish_sample(self, state: RequestState, index: int, status: SequenceStatus) -> None:
        seq = state.seqs[index]
        if seq.finish_reason is None:
            seq.finish_reason = status.value
            if state.text_at_finish_only:
                detokenizer.flush(self.tokenizer, seq, state.params, drop_last=False)

    def finish_request(self, request_id: str, status: SequenceStatus) -> None:
        """Every sample of user request `request_id` stops (a failed request)."""
        state = self.requests.get(request_id)
        if state is not None:
            for index in range(state.params.n):
                self._finish_sample(state, index, status)

    def add_prompt_logprobs(self, child_id: str, start: int, lp: torch.Tensor) -> None:
        """Logprobs of prompt tokens start+1 .. start+len(lp) from a prefill chunk's rows (of
        sample 0: the only child of an n > 1 request that asks for them)."""
        state = self._children[child_id][0]
        prompt = state.prompt_token_ids
        k = state.params.prompt_logprobs
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]
        top = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None
        for i in range(lp.shape[0]):
            pos = start + i + 1
            if pos >= len(prompt) or pos < len(state.prompt_logprobs):
                continue
            # Positions before prompt_logprobs_start (or served from the prefix cache) are None.
            state.prompt_logprobs.extend([None] * (pos - len(state.prompt_logprobs)))
            tok = prompt[pos]
            tok_lp = float(lp[i, tok])
            rank = int((lp[i] > lp[i, tok]).sum()) + 1
            state.prompt_logprobs.append(token_logprobs(
                self.tokenizer, tok, tok_lp, rank,
                top.indices[i].tolist() if top is not None else None,
                top.values[i].tolist() if top is not None else None, k))

    # ------------------------------------------------------------------ outputs
    def make_output(self, request_id: str) -> RequestOutput | None:
        """The request's output now (None for a final-only request still running); a
        finished request is forgotten."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        finished = state.is_finished
        if state.final_only and not finished:
            return None
        if finished:
            del self.requests[request_id]
            self._forget_children(state)
            if any(s.finish_reason != SequenceStatus.FINISHED_ABORTED.value for s in state.seqs.values()):
                self.stats["num_requests_finished"] += 1
        params = state.params
        completions = []
        for index in sorted(state.seqs):
            seq = state.seqs[index]
            done = seq.finish_reason is not None
            completions.append(CompletionOutput(
                index=index,
                text=detokenizer.visible_text(seq, params, done),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        self.num_outputs_built += 1
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            outputs=completions,
            finished=finished,
            prompt_logprobs=state.prompt_logprobs,
            metrics=_metrics(state, finished),
        )


def _metrics(state: RequestState, finished: bool) -> dict:
    """vLLM's RequestMetrics fields (wall-clock seconds since the epoch)."""
    metrics = {
        "arrival_time": state.arrival_time,
        "first_scheduled_time": state.first_scheduled_time,
        "first_token_time": state.first_token_time,
        "last_token_time": state.last_token_time,
        "time_in_queue": (state.first_scheduled_time - state.arrival_time
                          if state.first_scheduled_time is not None else None),
        "finished_time": time.time() if finished else None,
    }
    return metrics


def token_logprobs(tokenizer, sampled_id: int, sampled_lp: float, rank: int | None,
                   top_ids: list[int] | None, top_lps: list[float] | None, k: int) -> PositionLogprobs:
    """The top-k entries plus the sampled token, each with its rank and text."""
    entry: PositionLogprobs = {}
    if top_ids is not None:
        for r, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
            entry[tid] = Logprob(lp, r, tokenizer.decode([tid]))
    if sampled_id not in entry:
        entry[sampled_id] = Logprob(sampled_lp, rank, tokenizer.decode([sampled_id]))
    return entry


def check_stop(seq: SeqOutputState, params: SamplingParams, tokenizer, max_model_len: int,
               num_new_chars: int) -> SequenceStatus | None:
    token = seq.token_ids[-1]
    num_out = seq.num_output_tokens
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in params.eos_token_ids:
            detokenizer.flush(tokenizer, seq, params, drop_last=not params.include_stop_str_in_output)
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            seq.stop_reason = token
            detokenizer.flush(tokenizer, seq, params, drop_last=not params.include_stop_str_in_output)
            return SequenceStatus.FINISHED_STOPPED
        if params.stop and detokenizer.find_stop_string(seq, params, num_new_chars):
            return SequenceStatus.FINISHED_STOPPED
    if (params.max_tokens is not None and num_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
        detokenizer.flush(tokenizer, seq, params, drop_last=False)
        return SequenceStatus.FINISHED_LENGTH
    return None
