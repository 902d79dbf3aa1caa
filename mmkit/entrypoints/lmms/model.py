"""The lmms-eval model class: every request type through one mmkit `LLM`.

    python -m lmms_eval --model mmkit --model_args model=PATH,dtype=bfloat16,max_num_seqs=64 --tasks T

A request's prompt is a user turn of [its images or videos, its context] rendered with the
checkpoint's chat template. All requests of a call go to one continuously batched `generate`.
"""

from __future__ import annotations

import os
from typing import Any

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms

from mmkit.entrypoints.lmms.args import split_model_args
from mmkit.entrypoints.lmms.requests import sampling_params_from, split_visuals
from mmkit.eval.scoring import ScoreRequest, score_continuations, user_turn


class MMKit(lmms):
    """lmms-eval's `mmkit` model: `generate_until`, `generate_until_multi_round`, `loglikelihood`."""

    is_simple = True

    def __init__(self, model: str | None = None, pretrained: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        import torch

        from mmkit import LLM

        engine_args, options = split_model_args(kwargs)
        if options["threads"]:
            torch.set_num_threads(int(options["threads"]))
        self.max_new_tokens = int(options["max_new_tokens"])
        template = options["chat_template"]
        if template and os.path.isfile(template):  # a .jinja file, as lmms-eval's vLLM model takes
            with open(template, encoding="utf-8") as f:
                template = f.read()
        self.chat_template = template
        self.llm = LLM(model or pretrained, **engine_args)

    # ------------------------------------------------------------------ helpers
    def _doc(self, task: str, split: str, doc_id: int) -> dict:
        return self.task_dict[task][split][doc_id]

    def _visuals(self, doc_to_visual, task: str, split: str, doc_id: int) -> tuple[list, list]:
        if doc_to_visual is None:
            return [], []
        return split_visuals(doc_to_visual(self._doc(task, split, doc_id)))

    def _prompt(self, images: list, videos: list, context: str) -> dict:
        from mmkit.entrypoints.chat_utils import conversations_to_inputs

        engine = self.llm.llm_engine
        processor = engine.chat_processor()
        allow_video = engine.has_video_processor
        return conversations_to_inputs(processor, user_turn(images, videos, context), self.chat_template,
                                       allow_video=allow_video)[0]

    def _generate(self, prompts: list[dict], params: list) -> list[GenerationResult]:
        outs = self.llm.generate(prompts, params, use_tqdm=self.rank == 0)
        return [GenerationResult(text=o.outputs[0].text, token_counts=TokenCounts(
            input_tokens=len(o.prompt_token_ids), output_tokens=len(o.outputs[0].token_ids))) for o in outs]

    # ------------------------------------------------------------------ request types
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        prompts, params = [], []
        for req in requests:
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            images, videos = self._visuals(doc_to_visual, task, split, doc_id)
            prompts.append(self._prompt(images, videos, context))
            params.append(sampling_params_from(gen_kwargs, self.max_new_tokens, where=f"{task}[{doc_id}]"))
        return self._generate(prompts, params) if prompts else []

    def generate_until_multi_round(self, requests: list[Instance]) -> list[list[str]]:
        """Every round of every request in one batched generate; the task's `doc_to_text`
        gives each request's next round (visuals, context, done, round results, round info)."""
        active = []  # [request index, visuals, context, results so far, previous round info]
        params = []
        for i, req in enumerate(requests):
            context, gen_kwargs, doc_to_visual, _doc_to_text, doc_id, task, split = req.args
            active.append([i, self._visuals(doc_to_visual, task, split, doc_id), context, [], None])
            params.append(sampling_params_from(gen_kwargs, self.max_new_tokens, where=f"{task}[{doc_id}]"))
        final: dict[int, list[str]] = {}
        round_idx = 0
        while active:
            prompts = [self._prompt(*vis, ctx) for _i, vis, ctx, _r, _p in active]
            texts = [g.text for g in self._generate(prompts, [params[a[0]] for a in active])]
            round_idx += 1
            still = []
            for entry, text in zip(active, texts):
                i = entry[0]
                _ctx, _kw, _vis, doc_to_text, doc_id, task, split = requests[i].args
                entry[3].append(text)
                visuals, context, done, round_res, info = doc_to_text(
                    self._doc(task, split, doc_id), previous_output=list(entry[3]), round_idx=round_idx,
                    previous_round_info=entry[4])
                if round_res is not None:
                    entry[3] = list(round_res)
                if done:
                    final[i] = [str(t) for t in entry[3]]
                else:
                    entry[1] = split_visuals(visuals) if visuals is not None else ([], [])
                    entry[2], entry[4] = context, info
                    still.append(entry)
            active = still
        return [final[i] for i in range(len(requests))]

    def loglikelihood(self, requests: list[Instance]) -> list[GenerationResult]:
        """`(-sum log p(continuation), is_greedy)` per request, wrapped so lmms-eval keeps the
        pair (a bare tuple would be stringified); its multiple choice picks the lowest."""
        scored = []
        for req in requests:
            args = req.args
            if len(args) == 2:  # acc_mutual_info's unconditional requests: no document, no visuals
                scored.append(ScoreRequest(args[0], args[1]))
                continue
            context, target, doc_to_visual, doc_id, task, split = args
            continuation = target if isinstance(target, str) else target(self._doc(task, split, doc_id))
            images, videos = self._visuals(doc_to_visual, task, split, doc_id)
            scored.append(ScoreRequest(context, str(continuation), images, videos))
        pairs = score_continuations(self.llm, scored, chat_template=self.chat_template,
                                    use_tqdm=self.rank == 0) if scored else []
        return [GenerationResult(text=(nll, greedy)) for nll, greedy in pairs]
