"""LLMEngine: requests in, one `step()` at a time, `RequestOutput`s out.

Who owns what (vLLM v1's split): the `Scheduler` owns requests, their counters and blocks;
the `ModelRunner` gets an immutable `SchedulerOutput` per step and keeps its own
per-sequence cache; the `OutputProcessor` owns text, stop checks, logprobs, metrics and
`RequestOutput`s. A request with n > 1 samples is fanned out here, at add time, into n
independent scheduler requests (`engine/parent_request.py`, vLLM v1's `ParentRequest`) and
gathered back by the output processor. `step()` is the one step driver for `LLM`,
`AsyncLLMEngine` and evaluation, with one failure policy: a request that fails after admission (its image
cannot be processed) ends alone with its error (`take_request_errors`), the others go on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from mmkit.config import EngineArgs, EngineConfig
from mmkit.engine.block_manager import BlockManager, blocks_needed
from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.engine.output_processor import OutputProcessor
from mmkit.engine.parent_request import ParentRequests, child_request_id, fan_out
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.scheduler_output import SchedulerOutput
from mmkit.engine.state_cache_manager import StateCacheManager
from mmkit.engine.sequence import SequenceGroup, SequenceStatus
from mmkit.errors import RequestError
from mmkit.multimodal.legacy import legacy_single_input
from mmkit.multimodal import check_supported_modalities, supported_modalities
from mmkit.multimodal.parse import ParsedPrompt, parse_prompt
from mmkit.multimodal.prefetcher import MultiModalPrefetcher
from mmkit.multimodal.stage import MultiModalInputStage
from mmkit.outputs import RequestOutput
from mmkit.processors import ProcessedPrompt, get_input_processor
from mmkit.sampling_params import SamplingParams
from mmkit.worker.model_runner import ModelRunner


logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One engine step as the drivers see it: outputs, and the requests that failed."""

    outputs: list[RequestOutput]
    errors: dict[str, BaseException]  # request id -> its error (those requests have ended)


class LLMEngine:
    """The engine behind `LLM`: `add_request`, `step`, `abort_request`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.input_processor = get_input_processor(config.model, config.tokenizer_path,
                                                   config.limit_mm_per_prompt, config.mm_processor_kwargs)
        self.tokenizer = self.input_processor.tokenizer
        # The input stage: the items' processor work (on the prefetcher's workers), read by the
        # scheduler (admission) and the runner (model inputs); both get it here, at construction.
        self.input_stage = MultiModalInputStage(
            self.input_processor, config.preprocess_lookahead, config.mm_processor_workers,
            functools.partial(get_input_processor, config.model, config.tokenizer_path,
                              config.limit_mm_per_prompt, config.mm_processor_kwargs))
        self.model_runner = ModelRunner(config, self.input_processor)
        capabilities = config.model.capabilities  # what the family declares (models/interfaces.py)
        spec = capabilities.state_spec  # a hybrid decoder's per-request state (None: KV only)
        self.state_cache_manager = None if spec is None else StateCacheManager(
            config.scheduler.max_num_seqs, spec.bytes_per_slot(config.model.dtype))
        prefix_caching = config.cache.enable_prefix_caching
        if prefix_caching and spec is not None:
            # docs/architecture.md ("Hybrid decoders"): a block hit would need the state at that block.
            logger.warning("prefix caching is off for %s: its linear-attention/convolution layers keep a "
                           "per-request state that cached KV blocks cannot restore", config.model.architecture)
            prefix_caching = False
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.cache.block_size,
                                          prefix_caching, capabilities.sliding_window)
        self.encoder_cache_manager = EncoderCacheManager(config.cache.encoder_cache_memory)
        # One item-embedding row: hidden, times 1 + the DeepStack layers the family declares.
        row_bytes = (config.model.hidden_size * capabilities.embed_width_factor
                     * torch.empty((), dtype=config.model.dtype).element_size())
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.encoder_cache_manager, row_bytes,
                                   preprocess=self.input_stage if self.input_stage.prefetches else None,
                                   state_cache=self.state_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.max_model_len)
        self.parent_requests = ParentRequests()  # n > 1 requests: which children are still scheduled
        self.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._request_errors: dict[str, BaseException] = {}
        self._structured_backend = None  # xgrammar, built at the first constrained request

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    @property
    def prefetcher(self) -> MultiModalPrefetcher | None:
        """The input stage's worker pool (None with `async_preprocess=False`)."""
        return self.input_stage.prefetcher

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        """Unfinished scheduler requests (owned by the scheduler; an n > 1 request's children
        are under `"{index}_{request_id}"`)."""
        return self.scheduler.requests

    # ------------------------------------------------------------------ requests
    def process_request(self, request_id: str, parsed: ParsedPrompt, params: SamplingParams | None,
                        lora_request: Any = None) -> tuple[ProcessedPrompt, SamplingParams]:
        """Everything that can reject a request, without changing any engine state (a LoRA
        adapter is read into the adapter cache, which serves every later request)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: got {type(request_id).__name__}; expected str")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: got {type(params).__name__}; expected SamplingParams")
        ids = [request_id] + ([child_request_id(request_id, i) for i in range(params.n)] if params.n > 1 else [])
        for rid in ids:
            if rid in self.scheduler.requests or rid in self.parent_requests:
                raise ValueError(f"request_id: {rid!r} is already in use by an unfinished request")
        if lora_request is not None:
            from mmkit.lora.engine_checks import check_lora_request

            check_lora_request(self, request_id, parsed.index, lora_request)
        processed = self.process_inputs(parsed)
        if lora_request is not None:
            processed = dataclasses.replace(processed, lora_request=lora_request)
        self._check_fits(request_id, parsed.index, len(processed.prompt_token_ids))
        if params.structured_outputs is not None:
            try:  # compiled (and cached) now, so a grammar this tokenizer cannot serve fails here
                self.structured_backend.compile(params.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"inputs[{parsed.index}] (request {request_id!r}): {exc}") from exc
        return processed, params

    def process_inputs(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        """The family's processor on one parsed prompt, after the one generic refusal of a
        modality it does not declare (`supported_modalities`); its bidirectional spans only
        where the model declares them (`ModelCapabilities.bidirectional_spans`)."""
        check_supported_modalities(parsed, supported_modalities(self.input_processor),
                                   self.config.model.architecture)
        processed = self.input_processor.process(parsed)
        if processed.bidirectional_ranges and not self.config.model.capabilities.bidirectional_spans:
            raise ValueError(f"inputs[{parsed.index}]: the {self.config.model.architecture} processor marked "
                             "bidirectional spans, but its model class does not declare them (bidirectional_spans=True "
                             "in get_capabilities(), mmkit.models.interfaces.ModelCapabilities)")
        return processed

    @property
    def structured_backend(self):
        """The engine's xgrammar backend (tokenizer info built once, compiled-grammar cache).
        Built at the first constrained request, which also registers its sampler hook with the
        runner, so unconstrained workloads never pay for it."""
        if self._structured_backend is None:
            from mmkit.structured_outputs.backend import StructuredOutputBackend
            from mmkit.structured_outputs.hook import StructuredOutputHook

            vocab_size = self.config.model.hf_config.get_text_config().vocab_size
            backend = StructuredOutputBackend(self.tokenizer, vocab_size, self.eos_token_ids)
            self.model_runner.sampler_hooks.append(StructuredOutputHook(backend))
            self._structured_backend = backend
        return self._structured_backend

    def _check_fits(self, request_id: str, index: int, num_tokens: int) -> None:
        max_len = self.config.scheduler.max_model_len
        where = f"inputs[{index}] (request {request_id!r})"
        if num_tokens > max_len:
            raise ValueError(
                f"{where}: the prompt is {num_tokens} tokens (text plus image tokens); expected at most "
                f"max_model_len = {max_len}"
            )
        bs = self.config.cache.block_size
        cache_tokens = self.block_manager.num_blocks * bs
        if blocks_needed(num_tokens + 1, bs) > self.block_manager.num_blocks:
            raise ValueError(
                f"{where}: the prompt is {num_tokens} tokens but the whole KV cache holds {cache_tokens} "
                f"tokens ({self.block_manager.num_blocks} blocks of {bs}); it can never be scheduled"
            )

    def add_request(self, request_id: str, inputs: Any = None, params: SamplingParams | None = None,
                    *, prompt: Any = None, prompt_token_ids: Any = None, multi_modal_data: Any = None,
                    lora_request: Any = None) -> None:
        """Validate and queue one request (`inputs`: a prompt string or dict; `lora_request`: a
        `mmkit.LoRARequest` on an engine built with `enable_lora=True`)."""
        if prompt is not None or prompt_token_ids is not None or multi_modal_data is not None:
            inputs = legacy_single_input(inputs, prompt, prompt_token_ids, multi_modal_data, "add_request")
        if inputs is None:
            raise ValueError("inputs: missing; expected a prompt string or dict")
        parsed = parse_prompt(0, inputs)
        processed, params = self.process_request(request_id, parsed, params, lora_request)
        self.add_processed(request_id, processed, params)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams,
                      *, final_only: bool = False) -> None:
        """Queue a request `process_request` accepted. `final_only`: build its
        `RequestOutput` once, when it finishes (no per-step outputs)."""
        params = params.clone(eos_token_ids=self.eos_token_ids)
        children = fan_out(request_id, params, [self._seed(params, i) for i in range(params.n)])
        child_ids = [child.request_id for child in children]
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids,
                                          params, final_only, child_ids)
        self.parent_requests.add(request_id, child_ids)
        for child in children:
            self.scheduler.add_request(SequenceGroup.create(child.request_id, processed, child.params, child.seed))
            # The samples share one prompt: its items go through the processor once.
            shares = None if child.request_id == child_ids[0] else child_ids[0]
            self.input_stage.add_request(child.request_id, processed.images, processed.image_embeds, shares=shares)

    def add_lora(self, lora_request: Any) -> None:
        """Load and check an adapter before any request names it (vLLM's `add_lora`)."""
        from mmkit.lora.engine_checks import check_lora_request

        check_lora_request(self, "add_lora", 0, lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the cache (a running request naming it loads it again)."""
        manager = self.model_runner.lora_manager
        return manager.remove(lora_int_id) if manager is not None else False

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is not None:
            return (params.seed * 1_000_003 + index) % 2**64
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_source))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self._abort_children(rid)
            self.output_processor.remove(rid)
            self._request_errors.pop(rid, None)

    def _abort_children(self, request_id: str) -> bool:
        """Abort every scheduler request of user request `request_id`; True if one was held."""
        held = False
        for child_id in self.parent_requests.child_ids(request_id):
            held |= self.scheduler.abort_request(child_id) is not None
            self.parent_requests.child_done(child_id)
            self._release_images(child_id)
        return held

    # NOTE: the counts below are of user requests: an n > 1 request's children count once.
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) - self.parent_requests.num_extra_children

    def has_unfinished_request(self, request_id: str) -> bool:
        """Whether the engine still holds `request_id` (added, not yet finished or aborted)."""
        return any(c in self.scheduler.requests for c in self.parent_requests.child_ids(request_id))

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting): requests with a sequence in the running set, and the rest."""
        parent_id = self.parent_requests.parent_id
        running = len({parent_id(seq.group.request_id) for seq in list(self.scheduler.running)})
        return running, max(self.get_num_unfinished_requests() - running, 0)

    # ------------------------------------------------------------------ what callers may ask
    # Entry points (LLM.chat, the server, eval, Ray rows, lmms-eval) ask these instead of
    # reaching into `input_processor`: the processor is the engine's to own.
    def chat_processor(self) -> Any:
        """What renders a chat template: the checkpoint's HF processor, else its tokenizer."""
        return self.input_processor.hf_processor or self.tokenizer

    @property
    def supported_modalities(self) -> tuple[str, ...]:
        """The modalities this model's processor accepts ("image", "video")."""
        return supported_modalities(self.input_processor)

    @property
    def has_video_processor(self) -> bool:
        """Whether the processor can take a video (its HF video processor is loaded)."""
        return getattr(self.input_processor, "video_processor", None) is not None

    def take_request_errors(self) -> dict[str, BaseException]:
        """Requests that ended with an error since the last call (their final outputs, with
        finish_reason "abort", came from `step`)."""
        errors, self._request_errors = self._request_errors, {}
        return errors

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, post-process; outputs of requests that progressed
        (of final-only requests: only when they finish)."""
        if self.input_stage.prefetches:
            # An idle engine: the requests it will likely admit get all their images started
            # at once and prepared side by side; this thread waits for them (their content
            # hashes too) here, so the scheduler never blocks on the stage.
            self.input_stage.prepare_now(self.scheduler.likely_admitted())
        sched = self.scheduler.schedule()
        touched: dict[str, SequenceGroup] = {}
        for seq in self.scheduler.take_finished_while_scheduling():  # out of KV cache
            self.output_processor.finish_seq(seq.group.request_id, seq.status)
            touched[seq.group.request_id] = seq.group
        if not sched.is_empty:
            now = time.time()
            for new in sched.new_seqs:
                self.output_processor.record_scheduled(new.request_id, now)
            try:
                sched = self._with_mm_features(sched)
                result = self.model_runner.execute_model(sched)
            except RequestError as exc:  # belongs to some requests: they end, the rest go on
                self.scheduler.step_failed(sched)
                return self._outputs(touched) + self._fail_requests(exc)
            except BaseException:
                self.scheduler.step_failed(sched)
                raise
            self._postprocess(sched, result, touched)
        return self._outputs(touched)

    def _with_mm_features(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step's items with their model inputs from the input stage (vLLM's
        `mm_features`); an item whose processing failed fails its request alone."""
        if not any(e.item is not None for e in sched.encoder_inputs):
            return sched
        stage, inputs = self.input_stage, []
        for e in sched.encoder_inputs:
            if e.item is not None:
                try:
                    e = dataclasses.replace(e, mm_kwargs=stage.mm_item_inputs(e.request_id, e.item))
                except Exception as exc:  # noqa: BLE001 - attributed to the one request
                    raise RequestError([e.request_id],
                                       f"request {e.request_id!r}: image processing failed: {exc}") from exc
            inputs.append(e)
        return dataclasses.replace(sched, encoder_inputs=tuple(inputs))

    def _postprocess(self, sched, result, touched: dict[str, SequenceGroup]) -> None:
        out = result.sampler_output
        update = self.scheduler.update_from_output(
            sched, result.sampled_seq_ids, out.token_ids if out is not None else [])
        for seq in update.scheduled.values():
            touched[seq.group.request_id] = seq.group
        op = self.output_processor
        for seq_id, (start, lp) in result.prompt_logprobs.items():
            op.add_prompt_logprobs(update.scheduled[seq_id].group.request_id, start, lp)
        now = time.time()
        stage = self.input_stage
        for seq, row in update.samples:
            rid = seq.group.request_id
            if stage.holds(rid):  # its prompt is computed: the items' inputs are done
                stage.prompt_done(rid)
            status = op.process_sample(rid, out, row, now)
            if status is not None:
                self.scheduler.finish_seq(seq, status)

    def _outputs(self, touched: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """One output per user request that progressed (its children gathered); finished
        scheduler requests are forgotten."""
        op = self.output_processor
        parents = dict.fromkeys(pid for pid in map(op.parent_id, touched) if pid is not None)
        outputs = [o for o in map(op.make_output, parents) if o is not None]
        for rid, group in touched.items():
            if self.scheduler.remove_if_finished(group):
                self.parent_requests.child_done(rid)
                self._release_images(rid)
        return outputs

    def _release_images(self, request_id: str) -> None:
        self.input_stage.release(request_id)

    def _fail_requests(self, exc: RequestError) -> list[RequestOutput]:
        outputs = []
        # The failed scheduler requests' user requests end whole (every sibling sample too).
        parents = dict.fromkeys(self.output_processor.parent_id(rid) or rid for rid in exc.request_ids)
        for rid in parents:
            if not self._abort_children(rid):
                continue
            self.output_processor.finish_request(rid, SequenceStatus.FINISHED_ABORTED)
            output = self.output_processor.make_output(rid)
            if output is not None:
                outputs.append(output)
            self._request_errors[rid] = exc.__cause__ or exc
        return outputs

    def step_result(self) -> StepResult:
        """`step()` plus the request errors of the step, as every driver consumes them."""
        outputs = self.step()
        errors = self.take_request_errors()
        return StepResult([o for o in outputs if o.request_id not in errors], errors)

    # ------------------------------------------------------------------ metrics
    def get_metrics(self) -> dict[str, int]:
        metrics = dict(self.output_processor.stats)
        metrics["num_preemptions"] = self.scheduler.num_preemptions
        metrics["prefix_cache_queries"] = self.block_manager.num_cache_queries
        metrics["prefix_cache_hits"] = self.block_manager.num_cache_hits
        metrics["encoder_cache_hits"] = self.encoder_cache_manager.num_hits
        metrics["encoder_cache_misses"] = self.encoder_cache_manager.num_misses
        metrics["kv_blocks_total"] = self.block_manager.num_blocks
        metrics["kv_blocks_free"] = self.block_manager.num_free_blocks
        if self.state_cache_manager is not None:
            metrics.update(self.state_cache_manager.metrics())
        metrics.update(self._weight_bytes())
        return metrics

    def _weight_bytes(self) -> dict[str, int]:
        """Bytes of every weight held (scales and zero points included) and of the decoder's
        linear layers alone; fixed after load, computed once."""
        if getattr(self, "_weight_bytes_cache", None) is None:
            from mmkit.models.quantization import weight_bytes

            total, decoder = weight_bytes(self.model_runner.model)
            self._weight_bytes_cache = {"model_weight_bytes": total, "decoder_linear_weight_bytes": decoder}
        return dict(self._weight_bytes_cache)


def _eos_token_ids(config: EngineConfig, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(config.model.hf_config.get_text_config(), "eos_token_id", None))
    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(config.model.path, local_files_only=True).eos_token_id)
    except Exception:  # noqa: BLE001 - no generation_config.json is fine
        pass
    return tuple(dict.fromkeys(ids))
