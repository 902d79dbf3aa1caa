"""LLM: the offline entry point (`generate`, `chat`), vLLM-style."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from mmkit.config import EngineArgs
from mmkit.engine.llm_engine import LLMEngine
from mmkit.engine.request_driver import ErrorPolicy, RequestDriver, drive
from mmkit.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, check_beams_fit, run_beam_search
from mmkit.entrypoints.chat_utils import conversations_to_inputs
from mmkit.errors import RequestFailedError
from mmkit.lora.engine_checks import lora_request_list
from mmkit.multimodal.legacy import legacy_to_inputs
from mmkit.multimodal.media_fetch import MediaConnector
from mmkit.multimodal.parse import PromptInputs, parse_inputs
from mmkit.outputs import RequestOutput
from mmkit.sampling_params import SamplingParams


class LLM:
    """A vision-language model ready for offline batched generation.

    `LLM(model=None, **engine_args)`: `model` is a checkpoint folder or a model id
    already in the local HF cache; None loads the embedded default model. Every other keyword
    is an `EngineArgs` field (dtype, device, seed, max_model_len, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        # Checked before the model loads: a bad media option fails at once.
        self.media_connector = MediaConnector.from_engine_args(self.engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict[str, int]:
        return self.llm_engine.get_metrics()

    def generate(
        self,
        inputs: PromptInputs | Sequence[PromptInputs] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        prompts: Any = None,
        prompt: Any = None,
        prompt_token_ids: Any = None,
        multi_modal_data: Any = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a batch; outputs come back in input order.

        `inputs`: a string, `{"prompt": str, "multi_modal_data": ...}`,
        `{"prompt_token_ids": [...], "multi_modal_data": ...}` or a list mixing them.
        `sampling_params`: one `SamplingParams` for all, or a list of the same length.
        The legacy keywords `prompts=`/`prompt=`, `prompt_token_ids=` and `multi_modal_data=`
        still work and emit a DeprecationWarning.

        If some prompts fail after admission (an image that cannot be decoded), the others
        still complete and `mmkit.RequestFailedError` is raised: its `.outputs` holds every
        output in input order (None for the failed prompts) and `.failed` the errors by index.

        `lora_request`: a `mmkit.LoRARequest` for every input, or a list with one entry (or None,
        the base model) per input; the engine needs `enable_lora=True`.
        """
        if prompts is not None and prompt is not None:
            raise ValueError("LLM.generate: got both prompts= and prompt=; pass `inputs`")
        legacy_prompts, legacy_name = (prompt, "prompt") if prompt is not None else (prompts, "prompts")
        if legacy_prompts is not None or prompt_token_ids is not None or multi_modal_data is not None:
            if inputs is not None:
                raise ValueError("LLM.generate: got both `inputs` and legacy prompt arguments; pass only `inputs`")
            inputs = legacy_to_inputs(legacy_prompts, prompt_token_ids, multi_modal_data,
                                      prompt_name=legacy_name)
        if inputs is None:
            raise ValueError("LLM.generate: inputs: missing; expected a prompt string, dict or a list of them")
        parsed = parse_inputs(inputs, self.llm_engine.input_stage.map)
        params_list = self._params_list(sampling_params, len(parsed))
        return self._run(parsed, params_list, use_tqdm, lora_request_list(lora_request, len(parsed)))

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Messages are OpenAI-style: `{"role": "user", "content": "text"}` or content as a list
        of parts `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..." | "path/or/file://url" | "https://..."}}`,
        `{"type": "image", "image": PIL.Image}`; for video models (a processor whose
        `supported_modalities` holds "video") also
        `{"type": "video_url", "video_url": {"url": "movie.mp4" | [frames]}}` (files need PyAV)
        and `{"type": "video", "video": frames}`. Rendered with the checkpoint's chat template
        (or `chat_template`); returns one `RequestOutput` per conversation, like `generate`.
        URLs and paths load under the media options (`allowed_local_media_path`,
        `allowed_media_domains`, `image_fetch_timeout`, `max_image_fetch_bytes`, `max_image_pixels`;
        docs/serving.md "Media fetching"); a refusal is a `ValueError` naming the part and the limit.
        """
        processor = self.llm_engine.chat_processor()
        allow_video = "video" in self.llm_engine.supported_modalities
        inputs = conversations_to_inputs(processor, messages, chat_template, add_generation_prompt, allow_video,
                                         media=self.media_connector)
        return self.generate(inputs, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptInputs | Sequence[PromptInputs],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): one `BeamSearchOutput` per prompt, in input
        order, its `.sequences` best first (`.tokens`: prompt + generated ids, `.text`: the
        generated text, `.cum_logprob`).

        `prompts`: every form `generate` takes (a string, a token-id prompt, a dict with
        `multi_modal_data`, or a list of them). Each step asks the engine for one token of every
        live beam; the beams of a prompt share its KV blocks (prefix caching) and its image's
        embeddings (encoded once per prompt). Every prompt is validated before any request is
        added. See `mmkit.entrypoints.beam_search`.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: got {type(params).__name__}; expected BeamSearchParams")
        if prompts is None:
            raise ValueError("LLM.beam_search: prompts: missing; expected a prompt string, dict or a list of them")
        engine = self.llm_engine
        parsed = parse_inputs(prompts, engine.input_stage.map)
        # Validate everything before adding anything (the step requests reuse these).
        processed = [engine.process_request(f"beam-{p.index}-check", p, None)[0] for p in parsed]
        check_beams_fit(engine, processed, params)
        steps = tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True)
        with steps:
            return run_beam_search(engine, processed, params, lambda: f"beam-{next(self._request_counter)}",
                                   progress=iter(steps))

    @staticmethod
    def _params_list(sampling_params: Any, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != count:
                raise ValueError(
                    f"sampling_params: got a list of {len(sampling_params)}; expected one SamplingParams "
                    f"or a list of {count} (one per input)"
                )
            for i, p in enumerate(sampling_params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{i}]: got {type(p).__name__}; expected SamplingParams")
            return list(sampling_params)
        raise TypeError(f"sampling_params: got {type(sampling_params).__name__}; expected SamplingParams or a list")

    def _run(self, parsed, params_list, use_tqdm: bool, lora_requests=None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in parsed]
        lora_requests = lora_requests or [None] * len(parsed)
        results: dict[str, RequestOutput] = {}
        errors: dict[str, BaseException] = {}
        admissions = [(rid, functools.partial(engine.process_request, rid, p, sp, lr))
                      for rid, p, sp, lr in zip(ids, parsed, params_list, lora_requests)]
        self._drive(RequestDriver(engine), admissions, results, errors, use_tqdm)
        if errors:
            index = {rid: i for i, rid in enumerate(ids)}
            failed = {index[rid]: exc for rid, exc in errors.items()}
            error = RequestFailedError([results.get(rid) for rid in ids], failed,
                                       {index[rid]: rid for rid in errors})
            raise error from failed[min(failed)]
        return [results[rid] for rid in ids]

    @staticmethod
    def _drive(driver: RequestDriver, admissions, results: dict[str, RequestOutput],
               errors: dict[str, BaseException], use_tqdm: bool) -> None:
        """All-or-nothing (`ErrorPolicy.ALL_OR_NOTHING`): every input validated before any is
        added; a request that fails alone is collected in `errors` and raised after the run."""
        bar = tqdm(total=len(admissions), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        num_in = num_out = 0

        def on_error(rid: str, exc: BaseException) -> None:
            errors[rid] = exc
            bar.update(1)

        def on_output(out: RequestOutput) -> None:
            nonlocal num_in, num_out
            results[out.request_id] = out
            num_in += len(out.prompt_token_ids)
            num_out += sum(len(c.token_ids) for c in out.outputs)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"input: {num_in / elapsed:.1f} toks/s, "
                                f"output: {num_out / elapsed:.1f} toks/s", refresh=False)
            bar.update(1)

        try:
            drive(driver, admissions, policy=ErrorPolicy.ALL_OR_NOTHING, on_output=on_output, on_error=on_error)
        finally:
            bar.close()
