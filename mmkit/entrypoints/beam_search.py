"""Beam search at the LLM level, as vLLM's `LLM.beam_search` runs it.

Each step turns every live beam into a request for ONE token with `logprobs = 2 * beam_width`
(transformers keeps 2 * beam_width candidates per step for the same reason: enough survive when
some end with EOS). A beam's request is the prompt's `ProcessedPrompt` (processed once, up front)
with the beam's generated tokens appended to its ids, so:
- the prefix cache serves every beam the prompt's KV blocks and the blocks of the tokens the
  beams share (the image's blocks are keyed by its content hash, like any request's);
- the image is encoded once per prompt: a later step's chunk starts after the cached prefix,
  and where it reaches back into an image the embeddings come from the encoder cache.
Candidates are ranked by cumulative logprob (the model's raw distribution, as `generate`
reports logprobs); an EOS candidate (unless `ignore_eos`) ends its beam and is kept; the live
beams end at `max_tokens` (or at `max_model_len`). The result is every ended and live beam,
sorted by the length-penalized score, best first, at most `beam_width` of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mmkit.engine.block_manager import blocks_needed
from mmkit.engine.request_driver import ErrorPolicy, RequestDriver, drive, given
from mmkit.outputs import PositionLogprobs, RequestOutput
from mmkit.processors import ProcessedPrompt
from mmkit.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters, validated at construction (a ValueError names the field).

    `beam_width`: beams kept per prompt (1 is greedy decoding). `max_tokens`: most tokens
    generated per beam. `ignore_eos`: an EOS token is an ordinary token (every beam runs to
    `max_tokens`). `temperature`: of each step's one-token request, as vLLM passes it; the
    candidates are ranked by the model's raw logprobs, so above 0 it only adds each beam's
    sampled token to its candidates. `length_penalty`: the final ranking's exponent, score =
    cum_logprob / len(tokens) ** length_penalty (`len(tokens)`: prompt plus generated tokens,
    a final EOS not counted; vLLM's `get_beam_search_score`).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}; expected an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: got {self.ignore_eos!r}; expected True or False")
        for name, lo in (("temperature", 0.0), ("length_penalty", -math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < lo:
                expected = "a finite number >= 0" if lo == 0.0 else "a finite number"
                raise ValueError(f"{name}: got {value!r}; expected {expected}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's ids (image placeholders expanded, as
    `RequestOutput.prompt_token_ids`) then the generated ones, as vLLM's does; `text` is the
    generated text alone (a final EOS left out); `cum_logprob` sums the generated tokens'
    logprobs; `logprobs` holds each generated position's candidates (token id -> `Logprob`)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (after the prompt)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """One prompt's result: at most `beam_width` sequences, best (highest score) first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Instance:
    """The search state of one prompt."""

    processed: ProcessedPrompt
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(seq: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """cum_logprob / len ** length_penalty, a final EOS not counted (vLLM's rule)."""
    length = len(seq.tokens) - (1 if seq.finish_reason == "stop" and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (max(length, 1) ** length_penalty)


def check_beams_fit(engine, processed: list[ProcessedPrompt], params: BeamSearchParams) -> None:
    """Every beam must fit the KV cache at its longest (checked before anything is added)."""
    bs, num_blocks = engine.config.cache.block_size, engine.block_manager.num_blocks
    max_len = engine.config.scheduler.max_model_len
    for p in processed:
        longest = min(len(p.prompt_token_ids) + params.max_tokens, max_len)
        if blocks_needed(longest, bs) > num_blocks:
            raise ValueError(
                f"inputs[{p.index}]: a beam grows to {longest} tokens (prompt plus max_tokens = "
                f"{params.max_tokens}) but the whole KV cache holds {num_blocks * bs} tokens "
                f"({num_blocks} blocks of {bs}); lower max_tokens or enlarge the cache")


def run_beam_search(engine, processed: list[ProcessedPrompt], params: BeamSearchParams,
                    new_request_id: Callable[[], str], progress: Iterator | None = None) -> list[BeamSearchOutput]:
    """The search over validated prompts (`LLMEngine.process_request` accepted each one)."""
    eos = tuple(engine.eos_token_ids)
    max_len = engine.config.scheduler.max_model_len
    width = params.beam_width
    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width,
                                 ignore_eos=True)
    instances = [_Instance(p, [BeamSearchSequence(list(p.prompt_token_ids),
                                                  num_prompt_tokens=len(p.prompt_token_ids))])
                 for p in processed]

    def score(seq: BeamSearchSequence) -> float:
        return beam_search_score(seq, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        for inst in instances:  # a beam at max_model_len cannot take another token
            full = [b for b in inst.beams if len(b.tokens) >= max_len]
            for beam in full:
                beam.finish_reason = "length"
            inst.completed.extend(full)
            inst.beams = [b for b in inst.beams if len(b.tokens) < max_len]
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = _run_step(engine, [(inst.processed, beam) for inst, beam in live], step_params, new_request_id)
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outputs):
            position = out.outputs[0].logprobs[0]  # token id -> Logprob: top 2 * width + the sampled one
            for token_id, lp in position.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [position],
                                           beam.cum_logprob + lp.logprob, num_prompt_tokens=beam.num_prompt_tokens)
                if token_id in eos and not params.ignore_eos:
                    child.finish_reason = "stop"
                    inst.completed.append(child)
                else:
                    candidates[id(inst)].append(child)
        for inst in instances:
            # NOTE: the live beams all have the same length, so ranking them by score is
            # ranking them by cumulative logprob (sorted() is stable: ties keep beam order).
            inst.beams = sorted(candidates[id(inst)], key=score, reverse=True)[:width]
        if progress is not None:
            next(progress, None)

    results = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = "length"
        best = sorted(inst.completed + inst.beams, key=score, reverse=True)[:width]
        for seq in best:
            new = seq.output_token_ids
            if seq.finish_reason == "stop" and new and new[-1] in eos:
                new = new[:-1]
            seq.text = engine.tokenizer.decode(new, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results


def _run_step(engine, beams: list[tuple[ProcessedPrompt, BeamSearchSequence]], step_params: SamplingParams,
              new_request_id: Callable[[], str]) -> list[RequestOutput]:
    """One token for every live beam (one request each), in the order given."""
    ids = [new_request_id() for _ in beams]
    results: dict[str, RequestOutput] = {}

    def on_error(rid: str, exc: BaseException) -> None:  # all-or-nothing: one failed beam ends the search
        index = beams[ids.index(rid)][0].index
        raise RuntimeError(f"beam search: inputs[{index}] (request {rid!r}) failed: "
                           f"{type(exc).__name__}: {exc}") from exc

    def on_output(out: RequestOutput) -> None:
        results[out.request_id] = out

    admissions = [(rid, given((dataclasses.replace(processed, prompt_token_ids=list(beam.tokens)), step_params)))
                  for rid, (processed, beam) in zip(ids, beams)]
    drive(RequestDriver(engine), admissions, policy=ErrorPolicy.ALL_OR_NOTHING,
          on_output=on_output, on_error=on_error)
    return [results[rid] for rid in ids]
