"""Continuation scoring: -sum log p(continuation | context, images) and whether it is greedy.

Each context is a user turn of [images, text] rendered with the checkpoint's chat template
(generation prompt included); the continuation's text is appended raw after it, so no
end-of-turn or EOS token is scored. All requests run in one `generate` call with prompt
log-probs of the continuation positions only (`SamplingParams.prompt_logprobs_start`
counted from the end), so the prefix cache serves a shared context (the options of one
question) from the blocks the first option computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmkit.entrypoints.chat_utils import conversations_to_inputs
from mmkit.sampling_params import SamplingParams


@dataclass
class ScoreRequest:
    context: str
    continuation: str
    images: list[Any] = field(default_factory=list)  # PIL images (image_url parts need no loading)
    videos: list[Any] = field(default_factory=list)  # paths or frame lists (video models)


def user_turn(images: list[Any], videos: list[Any], text: str) -> list[dict[str, Any]]:
    """One user message: the images, then the videos, then the text."""
    content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
    content += [{"type": "video_url", "video_url": {"url": v}} for v in videos]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def score_continuations(llm, requests: list[ScoreRequest], *, chat_template: str | None = None,
                        use_tqdm: bool = False) -> list[tuple[float, bool]]:
    """`(-sum log p, is_greedy)` of each request's continuation, in input order
    (`chat_template`: instead of the checkpoint's)."""
    engine = llm.llm_engine
    processor = engine.chat_processor()
    tokenizer = llm.get_tokenizer()
    allow_video = engine.has_video_processor
    inputs, params, counts = [], [], []
    for i, req in enumerate(requests):
        if not req.continuation:
            raise ValueError(f"requests[{i}].continuation: got an empty string; expected the text to score")
        ctx = conversations_to_inputs(processor, user_turn(req.images, req.videos, req.context), chat_template,
                                      allow_video=allow_video)[0]
        full = ctx["prompt"] + req.continuation
        # Placeholders are one token before expansion and sit before the continuation, so the
        # continuation's token count is the difference of the two unexpanded tokenizations.
        ctx_ids = tokenizer(ctx["prompt"]).input_ids
        full_ids = tokenizer(full).input_ids
        count = len(full_ids) - len(ctx_ids)
        if count <= 0 or full_ids[:len(ctx_ids)] != ctx_ids:
            raise ValueError(f"requests[{i}].continuation: {req.continuation!r} does not tokenize as whole "
                             f"tokens after the context (it merges with the prompt's last token)")
        inputs.append({**ctx, "prompt": full})
        params.append(SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                     prompt_logprobs_start=-count))
        counts.append(count)
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    results = []
    for out, count in zip(outputs, counts):
        ids = out.prompt_token_ids[-count:]
        positions = out.prompt_logprobs[-count:]
        logprobs = [pos[tok] for pos, tok in zip(positions, ids)]
        results.append((-sum(lp.logprob for lp in logprobs), all(lp.rank == 1 for lp in logprobs)))
    return results
