"""ModelRunner: turns one `SchedulerOutput` into a forward pass and sampled tokens.

`execute_model` is the one call per engine step that runs the model: the encoder work the
scheduler scheduled, batch preparation (input ids, positions, slot mapping, block tables),
the merge of item embeddings into placeholder rows (`models/interfaces.py`),
the decoder forward on the paged cache, the LM head on the last positions and the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mmkit.config import EngineConfig
from mmkit.errors import RequestError
from mmkit.layers.attention import AttentionMetadata, PrefillChunk, build_decode_metadata
from mmkit.layers.attention_backend import attach_backend, select_attention_backend
from mmkit.layers.gpu_sampler import GpuSampler
from mmkit.layers.sampler import Sampler, SamplerOutput, SamplingRow
from mmkit.engine.scheduler_output import SchedulerOutput
from mmkit.models.interfaces import EmbedSlice, merge_multimodal_embeddings, placeholder_slices
from mmkit.worker.block_table import BlockTables
from mmkit.worker.cuda_graphs import DecodeGraphs, uses_decode_graphs
from mmkit.worker.encoder_cache import EncoderCache
from mmkit.worker.kv_cache import allocate_kv_caches, num_blocks_for
from mmkit.worker.memory_profiler import needs_profile, profiled_num_blocks
from mmkit.worker.model_loader import load_model
from mmkit.worker.seq_state import CachedSeqState, Chunk, SamplerHook
from mmkit.lora.runner_steps import begin_step, encode_per_adapter, lora_id, rows_of
from mmkit.worker.state_cache import StateBatch, StateCache


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens for the scheduled chunks that reached the end of their sequence."""

    sampled_seq_ids: list[int]  # one per row of `sampler_output`, in row order
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (chunk start, [chunk_len, vocab])


class ModelRunner:
    def __init__(self, config: EngineConfig, input_processor: Any = None) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        # The family's processor, for the CUDA memory profile's dummy images only: a step's
        # item inputs arrive in its scheduler output (`EncoderInput.mm_kwargs`).
        self.input_processor = input_processor
        self.model = load_model(mc)
        if self.device.type == "cpu":
            _release_freed_memory()  # checkpoint read buffers and unpacked weights, freed above
        self.capabilities = mc.capabilities  # what the family declares (models/interfaces.py)
        self.attention_backend = select_attention_backend(self.device, config.attention_backend,
                                                          config.cache.block_size)
        self.memory_profile = None  # CUDA: the profiling run's figures (worker/memory_profiler.py)
        self.num_blocks = (profiled_num_blocks(self) if needs_profile(config)
                           else num_blocks_for(mc, config.cache, config.scheduler.max_num_seqs))
        graphs = uses_decode_graphs(config, self.attention_backend, self)
        # Blocks in the cache tensors: the null block too when decode graphs pad with it.
        self.num_cache_blocks = self.num_blocks + int(graphs)
        self.kv_caches = allocate_kv_caches(mc, self.num_cache_blocks, self.block_size,
                                            preallocate=config.cache.kv_cache_preallocate)
        # A hybrid decoder's per-request state: one slot per sequence that can run.
        spec = self.capabilities.state_spec
        self.state_cache = (StateCache(spec, config.scheduler.max_num_seqs, self.dtype, self.device)
                            if spec is not None else None)
        self.sampler = GpuSampler() if self.device.type == "cuda" else Sampler()  # one host sync per step
        self.encoder_cache = EncoderCache(config.cache.encoder_cache_memory)
        self.num_vision_calls = 0  # images encoded by the vision tower (for tests/metrics)
        self.sampler_hooks: list[SamplerHook] = []  # sampler-side features (see seq_state.py)
        self.lora_manager = None  # mmkit/lora/: adapter slots and the step's row -> slot mapping
        if config.lora is not None:
            from mmkit.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, config.lora, self.dtype, self.device)
        self._init_batch_state()
        # CUDA graphs for decode steps; with LoRA or a hybrid decoder's state every step runs
        # eagerly (a captured graph holds no per-row adapter deltas nor state-slot gathers).
        self.decode_graphs = (DecodeGraphs(self) if graphs and self.lora_manager is None
                             and self.state_cache is None else None)
        if self.decode_graphs is not None:
            self.decode_graphs.capture()

    def _init_batch_state(self) -> None:
        self.states: dict[int, CachedSeqState] = {}  # seq_id -> the runner's per-sequence cache
        # Every state's block table again, as rows of one tensor: decode metadata is a gather.
        self.block_tables = BlockTables()

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        self._run_encoder(sched)
        # Decode tokens (chunks of one token) first, then prefill chunks.
        chunks = []
        for seq_id, num_new in sched.num_scheduled_tokens.items():
            state = self.states[seq_id]
            chunks.append(Chunk(state, state.num_computed_tokens, state.num_computed_tokens + num_new))
        if self.lora_manager is None:
            order = sorted(chunks, key=lambda c: c.num_new_tokens > 1)
        else:  # rows of one adapter next to each other (one delta matmul per adapter and layer)
            order = sorted(chunks, key=lambda c: (c.num_new_tokens > 1, lora_id(c.state)))
            begin_step(self.lora_manager, [c.state for c in order], [c.num_new_tokens for c in order])
        hidden = self.decode_graphs.try_run(order) if self.decode_graphs is not None else None
        if hidden is None:  # eager: every step on CPU, and prefill (or too large) steps on CUDA
            input_ids, positions, slots, meta = self._prepare(order)
            if self.state_cache is not None:
                meta.state_batch = self._state_batch(order)
            if self.capabilities.uses_mrope:
                positions = self._mrope_positions(order)
            embeds = self.model.embed_tokens(input_ids)
            embeds = self._merge_multimodal(order, embeds)
            hidden = self.model(embeds, positions, self.kv_caches, meta)
        # Logits only for the last position of chunks that complete their sequence.
        sampled, rows, last_rows = [], [], []
        row = 0
        prompt_lp: dict[int, tuple[int, torch.Tensor]] = {}
        for c in order:
            state = c.state
            if state.params.prompt_logprobs is not None and state.num_output_tokens == 0:
                # Rows before prompt_logprobs_start - 1 score positions nobody asked for.
                first = min(max(c.start, state.params.first_prompt_logprob(state.num_prompt_tokens) - 1), c.end)
                if first < c.end:
                    lo = row + first - c.start
                    with rows_of(self.lora_manager, [state] * (row + c.num_new_tokens - lo)):
                        prompt_lp[state.seq_id] = (first, self._chunk_logprobs(hidden[lo:row + c.num_new_tokens]))
            row += c.num_new_tokens
            state.num_computed_tokens = c.end
            if not c.samples:
                continue
            sampled.append(state)
            last_rows.append(row - 1)
            rows.append(self._sampling_row(state))
        if not sampled:
            return ModelRunnerOutput([], None, prompt_lp)
        with rows_of(self.lora_manager, sampled):
            logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        # NOTE: hooks act only on sequences that hold sampler state (e.g. a grammar matcher);
        # a step without any keeps the model-dtype logits and skips the [rows, vocab] copy,
        # even after a hook was registered by an earlier constrained request.
        if self.sampler_hooks and any(s.sampler_state for s in sampled):
            logits = logits.float()  # hooks get float32 rows (seq_state.SamplerHook)
            for hook in self.sampler_hooks:
                hook.apply(logits, sampled)
        out = self.sampler(logits, rows)
        for state, token in zip(sampled, out.token_ids):
            state.token_ids.append(token)  # the runner's own copy of the tokens
            for hook in self.sampler_hooks:
                hook.on_sampled(state, token)
        return ModelRunnerOutput([s.seq_id for s in sampled], out, prompt_lp)

    def _update_states(self, sched: SchedulerOutput) -> None:
        tables = self.block_tables
        for seq_id in sched.finished_seq_ids:
            self.states.pop(seq_id, None)
            tables.remove(seq_id)
        for d in sched.new_seqs:
            old = self.states.get(d.seq_id)  # a rebuild keeps its generator (and sampler state)
            generator = old.generator if old is not None else self._make_generator(d.seed)
            state = self.states[d.seq_id] = CachedSeqState(
                seq_id=d.seq_id, request_id=d.request_id, token_ids=list(d.token_ids),
                prompt_token_ids=d.token_ids[:d.num_prompt_tokens], params=d.sampling_params,
                generator=generator, block_table=list(d.block_ids), num_computed_tokens=d.num_computed_tokens,
                placeholder_ranges=d.placeholder_ranges, encoder_keys=d.encoder_keys,
                mrope_positions=d.mrope_positions, mrope_position_delta=d.mrope_position_delta,
                bidirectional_ranges=d.bidirectional_ranges, lora_request=d.lora_request, state_slot=d.state_slot)
            tables.set_table(d.seq_id, d.block_ids)
            if self.state_cache is not None:
                self._start_state(d)
            if old is not None:  # a rebuild: per-sequence sampler objects carry over
                state.sampler_state = old.sampler_state
            else:
                for hook in self.sampler_hooks:
                    hook.on_new_seq(state)
        for c in sched.cached_seqs:
            state = self.states[c.seq_id]
            state.block_table.extend(c.new_block_ids)
            tables.append(c.seq_id, c.new_block_ids)
            state.num_computed_tokens = c.num_computed_tokens

    def _start_state(self, d) -> None:
        # NOTE: a state holds every token before num_computed_tokens, so a hybrid sequence
        # reaches the runner only from token 0 (no prefix-cache hit, a preempted or
        # failed one recomputed): its slot starts from zeros.
        if d.state_slot < 0 or d.num_computed_tokens != 0:
            raise RuntimeError(f"request {d.request_id!r}: a hybrid decoder's sequence must start from token 0 with "
                               f"a state slot (got slot {d.state_slot}, {d.num_computed_tokens} tokens computed)")
        self.state_cache.reset(d.state_slot)

    def _state_batch(self, order: list[Chunk]) -> StateBatch:
        """The step's rows by state slot: one-token rows first (the order `_prepare` laid out)."""
        decode_slots, prefills, row = [], [], 0
        for c in order:
            if c.num_new_tokens == 1:
                decode_slots.append(c.state.state_slot)
            else:
                prefills.append((row, c.num_new_tokens, c.state.state_slot))
            row += c.num_new_tokens
        return StateBatch(self.state_cache, len(decode_slots), _to_device(decode_slots, self.device), tuple(prefills))

    def _make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _chunk_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float().log_softmax(dim=-1)

    def _sampling_row(self, state: CachedSeqState) -> SamplingRow:
        params = state.params
        # NOTE: only penalties and min_tokens read the output ids; skip the O(length) copy
        # in the decode loop for every other request.
        output_ids = state.token_ids[state.num_prompt_tokens:] if (params.has_penalties or params.min_tokens) else []
        position = len(state.token_ids)
        return SamplingRow(params, state.generator, state.prompt_token_ids, output_ids, position)

    # ------------------------------------------------------------------ batch preparation
    def _prepare(self, order: list[Chunk]):
        """Flat step inputs. Built from Python ints and turned into tensors once per step
        (no per-sequence tensor ops): decode rows cost O(1) each, whatever their length."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_seq_ids: list[int] = []
        prefills: list[PrefillChunk] = []
        for c in order:
            state = c.state
            table = state.block_table
            start, end = c.start, c.end
            # NOTE: one token inside a bidirectional span (a prefix-cache hit up to the prompt's
            # last token) is a prefill chunk: its query must see the whole span.
            if end - start == 1 and not any(lo <= start < lo + n for lo, n in state.bidirectional_ranges):
                ids.append(state.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
                decode_seq_ids.append(state.seq_id)
                continue
            ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            spans = tuple((lo, lo + n) for lo, n in state.bidirectional_ranges if lo < end and lo + n > start)
            prefills.append(PrefillChunk(len(ids) - (end - start), end - start, end,
                                         self.block_tables.row(state.seq_id).clone().to(self.device), spans))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=_to_device(slots, dev), prefills=prefills, block_size=bs)
        if decode_tables:
            # Each decode's live blocks, gathered from the persistent rows (no per-step flattening).
            block_ids = self.block_tables.gather(decode_seq_ids, [-(-n // bs) for n in decode_lens])
            build_decode_metadata(meta, decode_tables, decode_lens, bs, dev, block_ids)
        attach_backend(meta, self.attention_backend, self.num_cache_blocks)
        return _to_device(ids, dev), _to_device(positions, dev), meta.slot_mapping, meta

    # ------------------------------------------------------------------ multimodal items
    def _run_encoder(self, sched: SchedulerOutput) -> None:
        """Drop the entries the scheduler freed, then encode the items it scheduled.

        Every item of the step goes through `embed_multimodal` in one call; results are
        stored only when all of them succeeded (a failed step leaves no half-filled cache)."""
        store = self.encoder_cache
        for key in sched.free_encoder_keys:
            store.pop(key)
        if not sched.encoder_inputs:
            return
        fresh: dict[str, torch.Tensor] = {}
        to_encode, item_inputs = [], []
        for e in sched.encoder_inputs:
            if e.embeds is not None:  # given by the user: no vision tower
                fresh[e.key] = e.embeds.to(self.device, self.dtype)
                continue
            inputs = e.mm_kwargs  # attached by the engine (vLLM's mm_features)
            to_encode.append(e)
            item_inputs.append({k: v.to(self.device) for k, v in inputs.items()})
        if item_inputs and self.lora_manager is not None and self.config.scheduler.lora_tower:
            embeds = encode_per_adapter(self.lora_manager, self.model, to_encode, item_inputs)
            self.num_vision_calls += sum(1 for i in item_inputs if "image_embeds" not in i)
            fresh.update((e.key, emb) for e, emb in zip(to_encode, embeds))
        elif item_inputs:
            embeds = self.model.embed_multimodal(item_inputs)  # one [num_tokens_i, hidden] per item
            self.num_vision_calls += sum(1 for i in item_inputs if "image_embeds" not in i)  # given rows: no tower
            fresh.update((e.key, emb) for e, emb in zip(to_encode, embeds))
        for e in sched.encoder_inputs:
            got = fresh[e.key].shape[0]
            if got != e.num_tokens:
                error = ValueError(f"request {e.request_id!r}: an image produced {got} embedding rows but its "
                                   f"placeholder range has {e.num_tokens} tokens; refusing to misalign them")
                raise RequestError([e.request_id], str(error)) from error
        for key, value in fresh.items():
            store.put(key, value)

    def _merge_multimodal(self, order: list[Chunk], embeds: torch.Tensor) -> torch.Tensor:
        """Scatter cached item embeddings into the placeholder rows this step computes; a
        family declaring DeepStack layers gets its step embeddings widened first (zeros) to its
        item width (`ModelCapabilities.embed_width_factor`)."""
        items: list[torch.Tensor] = []
        index: dict[str, int] = {}
        slices: list[EmbedSlice] = []
        row = 0
        for c in order:
            state = c.state
            if state.placeholder_ranges:
                for sl in placeholder_slices(state.placeholder_ranges, c.start, c.end, row):
                    key = state.encoder_keys[sl.item]
                    if key not in index:
                        value = self.encoder_cache.get(key)
                        if value is None:  # pragma: no cover - the scheduler's invariant
                            raise RuntimeError(f"request {state.request_id!r}: encoder cache entry {key!r} missing")
                        index[key] = len(items)
                        items.append(value)
                    slices.append(replace(sl, item=index[key]))
            row += c.num_new_tokens
        factor = self.capabilities.embed_width_factor
        if slices and factor > 1:
            wide = embeds.new_zeros(embeds.shape[0], embeds.shape[1] * factor)
            wide[:, :embeds.shape[1]] = embeds
            embeds = wide
        return merge_multimodal_embeddings(embeds, items, slices)

    def _mrope_positions(self, order: list[Chunk]) -> torch.Tensor:
        """[3, num_tokens] positions for a family declaring `uses_mrope`: the processor's rows for
        prompt tokens, index + delta (in all three rows) for generated ones."""
        parts = []
        for c in order:
            state = c.state
            table = state.mrope_positions  # [3, num_prompt_tokens]
            num_prompt = table.shape[1] if table is not None else 0
            lo, hi = c.start, c.end
            if lo < num_prompt:
                parts.append(table[:, lo:min(hi, num_prompt)])
            if hi > num_prompt:
                gen = torch.arange(max(lo, num_prompt), hi) + state.mrope_position_delta
                parts.append(gen.expand(3, -1))
        return torch.cat(parts, dim=1).to(self.device)


def _release_freed_memory() -> None:
    """Hand memory freed during loading back to the OS (glibc keeps freed heap pages
    resident otherwise: ~200 MB for the benchmark model). A no-op without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
