"""LLMEngine: requests in, one `step()` at a time, `RequestOutput`s out."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from mmkit.config import EngineArgs, EngineConfig
from mmkit.engine import detokenizer, output_builder
from mmkit.engine.block_manager import BlockManager, blocks_needed
from mmkit.engine.encoder_cache_manager import EncoderCacheManager
from mmkit.engine.scheduler import Scheduler
from mmkit.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from mmkit.inputs import ParsedPrompt, parse_prompt
from mmkit.legacy import legacy_single_input
from mmkit.outputs import RequestOutput
from mmkit.processors import ProcessedPrompt, get_input_processor
from mmkit.sampling_params import SamplingParams
from mmkit.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


class LLMEngine:
    """The engine behind `LLM`: `add_request`, `step`, `abort_request`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.input_processor = get_input_processor(config.model, config.tokenizer_path,
                                                   config.limit_mm_per_prompt)
        self.tokenizer = self.input_processor.tokenizer
        self.model_runner = ModelRunner(config, self.input_processor)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.encoder_cache_manager = EncoderCacheManager(config.cache.encoder_cache_memory)
        row_bytes = config.model.hidden_size * torch.empty((), dtype=config.model.dtype).element_size()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.encoder_cache_manager, row_bytes)
        self.groups: dict[str, SequenceGroup] = {}
        self.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._structured_backend = None  # xgrammar, built at the first constrained request
        self.stats = {"num_requests_finished": 0, "prompt_tokens": 0, "generation_tokens": 0}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    # ------------------------------------------------------------------ requests
    def process_request(self, request_id: str, parsed: ParsedPrompt,
                        params: SamplingParams | None) -> tuple[ProcessedPrompt, SamplingParams]:
        """Everything that can reject a request, without changing any engine state."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: got {type(request_id).__name__}; expected str")
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: got {type(params).__name__}; expected SamplingParams")
        processed = self.input_processor.process(parsed)
        self._check_fits(request_id, parsed.index, len(processed.prompt_token_ids))
        if params.structured_outputs is not None:
            try:  # compiled (and cached) now, so a grammar this tokenizer cannot serve fails here
                self.structured_backend.compile(params.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"inputs[{parsed.index}] (request {request_id!r}): {exc}") from exc
        return processed, params

    @property
    def structured_backend(self):
        """The engine's xgrammar backend (tokenizer info built once, compiled-grammar cache)."""
        if self._structured_backend is None:
            from mmkit.structured_outputs.backend import StructuredOutputBackend

            vocab_size = self.config.model.hf_config.get_text_config().vocab_size
            self._structured_backend = StructuredOutputBackend(self.tokenizer, vocab_size, self.eos_token_ids)
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
                    *, prompt: Any = None, prompt_token_ids: Any = None, multi_modal_data: Any = None) -> None:
        """Validate and queue one request (`inputs`: a prompt string or dict)."""
        if prompt is not None or prompt_token_ids is not None or multi_modal_data is not None:
            inputs = legacy_single_input(inputs, prompt, prompt_token_ids, multi_modal_data, "add_request")
        if inputs is None:
            raise ValueError("inputs: missing; expected a prompt string or dict")
        parsed = parse_prompt(0, inputs)
        processed, params = self.process_request(request_id, parsed, params)
        self.add_processed(request_id, processed, params)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams) -> None:
        params = params.clone(eos_token_ids=self.eos_token_ids)
        group = SequenceGroup(request_id=request_id, processed=processed, params=params)
        seqs = [Sequence(group=group, index=i, token_ids=list(processed.prompt_token_ids),
                         num_prompt_tokens=len(processed.prompt_token_ids),
                         generator=self._generator(params, i)) for i in range(params.n)]
        if params.structured_outputs is not None:  # the n - 1 others fork it (see _fork)
            seqs[0].structured = self.structured_backend.new_request(params.structured_outputs)
        group.seqs = seqs[:1]
        group.pending_forks = seqs[1:]
        seqs[0].num_pending_forks = params.n - 1
        self.groups[request_id] = group
        self.scheduler.add_group(group)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        gen = torch.Generator(device=self.model_runner.device)
        if params.seed is not None:
            gen.manual_seed((params.seed * 1_000_003 + index) % 2**64)
        else:
            gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._seed_source)))
        return gen

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            if group is not None:
                self.scheduler.abort_group(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, post-process; outputs of requests that progressed."""
        sched = self.scheduler.schedule()
        touched: dict[str, SequenceGroup] = {s.group.request_id: s.group for s in sched.out_of_cache}
        if not sched.is_empty:
            try:
                result = self.model_runner.execute_model(sched)
            except BaseException:
                self.scheduler.step_failed(sched)
                raise
            for s in sched.scheduled:
                s.seq.num_computed_tokens = s.end
                touched[s.seq.group.request_id] = s.seq.group
            self.scheduler.finish_step(sched)
            self._postprocess(result, sched)
        outputs = []
        for rid, group in touched.items():
            outputs.append(output_builder.build_output(group))
            if group.is_finished and self.groups.get(rid) is group:
                del self.groups[rid]
                self.stats["num_requests_finished"] += 1
        return outputs

    def _postprocess(self, result: ModelRunnerOutput, sched) -> None:
        for s in sched.scheduled:
            lp = result.prompt_logprobs.get(s.seq.group.request_id)
            if lp is not None:
                start = s.seq.num_computed_tokens - s.num_new_tokens  # step() already advanced it
                output_builder.prompt_logprobs_for(self.tokenizer, s.seq.group, start, lp)
        row = 0
        for s, count in zip(result.sampled, result.row_counts):
            seq = s.seq
            group = seq.group
            if seq.num_output_tokens == 0:  # first sample (not a recompute after preemption)
                self.stats["prompt_tokens"] += seq.num_prompt_tokens
            targets = [seq]
            if seq.num_pending_forks:
                targets += self._fork(seq, count - 1)
            for i, target in enumerate(targets):
                output_builder.append_sample(target, result.sampler_output, row + i, self.tokenizer)
                self.stats["generation_tokens"] += 1
                new_chars = len(detokenizer.decode_incrementally(self.tokenizer, target, group.params))
                status = output_builder.check_stop(target, self.tokenizer,
                                                   self.config.scheduler.max_model_len, new_chars)
                if target.structured is not None and status is None and not _advance_grammar(target):
                    detokenizer.flush(self.tokenizer, target, group.params, drop_last=False)
                    status = SequenceStatus.FINISHED_STOPPED
                if status is not None:
                    self.scheduler.finish_seq(target, status)
            row += count

    def _fork(self, parent: Sequence, num_children: int) -> list[Sequence]:
        group = parent.group
        children = group.pending_forks[:num_children]
        group.pending_forks = group.pending_forks[num_children:]
        parent.num_pending_forks = 0
        for child in children:
            if parent.structured is not None:  # before the parent accepts this step's token
                child.structured = parent.structured.fork()
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            self.block_manager.fork(parent, child)
            group.seqs.append(child)
            self.scheduler.add_running(child)
        return children

    # ------------------------------------------------------------------ metrics
    def get_metrics(self) -> dict[str, int]:
        metrics = dict(self.stats)
        metrics["num_preemptions"] = self.scheduler.num_preemptions
        metrics["prefix_cache_queries"] = self.block_manager.num_cache_queries
        metrics["prefix_cache_hits"] = self.block_manager.num_cache_hits
        metrics["encoder_cache_hits"] = self.encoder_cache_manager.num_hits
        metrics["encoder_cache_misses"] = self.encoder_cache_manager.num_misses
        metrics["kv_blocks_total"] = self.block_manager.num_blocks
        metrics["kv_blocks_free"] = self.block_manager.num_free_blocks
        return metrics


def _advance_grammar(seq: Sequence) -> bool:
    """Feed the sampled token to the sequence's matcher; False when the grammar is over: EOS
    accepted while `ignore_eos` kept the sequence going, or (only possible when min_tokens or
    a NaN defeats the mask) a token the grammar forbids."""
    token = seq.token_ids[-1]
    if not seq.structured.accept(token):
        logger.warning("request %r: token %d is outside its grammar; finishing the sequence",
                       seq.group.request_id, token)
        return False
    return not seq.structured.is_terminated()


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
