"""Post-processing of one step's samples: append tokens, logprobs, stop checks, outputs."""

from __future__ import annotations

import torch

from mmkit.engine import detokenizer
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.layers.sampler import SamplerOutput
from mmkit.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


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


def append_sample(seq: Sequence, out: SamplerOutput, row: int, tokenizer) -> None:
    token = out.token_ids[row]
    seq.token_ids.append(token)
    if out.logprobs is not None:  # computed only in steps where some request asks for logprobs
        seq.cumulative_logprob += out.logprobs[row]
    k = seq.group.params.logprobs
    if k is not None:
        seq.logprobs.append(token_logprobs(
            tokenizer, token, out.logprobs[row], out.ranks[row] if out.ranks else None,
            out.top_ids[row] if out.top_ids else None,
            out.top_logprobs[row] if out.top_logprobs else None, k))


def prompt_logprobs_for(tokenizer, group: SequenceGroup, start: int, lp: torch.Tensor) -> None:
    """Record logprobs of prompt tokens start+1 .. start+len(lp) from a prefill chunk's rows."""
    prompt = group.prompt_token_ids
    k = group.params.prompt_logprobs
    if group.prompt_logprobs is None:
        group.prompt_logprobs = [None]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None
    for i in range(lp.shape[0]):
        pos = start + i + 1
        if pos >= len(prompt) or pos < len(group.prompt_logprobs):
            continue
        tok = prompt[pos]
        tok_lp = float(lp[i, tok])
        rank = int((lp[i] > lp[i, tok]).sum()) + 1
        group.prompt_logprobs.append(token_logprobs(
            tokenizer, tok, tok_lp, rank,
            top.indices[i].tolist() if top is not None else None,
            top.values[i].tolist() if top is not None else None, k))


def check_stop(seq: Sequence, tokenizer, max_model_len: int, num_new_chars: int) -> SequenceStatus | None:
    params = seq.group.params
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


def build_output(group: SequenceGroup) -> RequestOutput:
    finished = group.is_finished
    params = group.params
    completions = []
    for seq in group.seqs:
        reason = seq.status.value if seq.is_finished else None
        completions.append(CompletionOutput(
            index=seq.index,
            text=detokenizer.visible_text(seq, params, seq.is_finished),
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(seq.logprobs) if params.logprobs is not None else None,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
        ))
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.processed.prompt,
        prompt_token_ids=list(group.prompt_token_ids),
        outputs=completions,
        finished=finished,
        prompt_logprobs=group.prompt_logprobs,
    )
