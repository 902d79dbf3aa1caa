"""ModelRunner: turns one `SchedulerOutput` into a forward pass and sampled tokens.

`execute_model` is the one call per engine step that runs the model: the encoder work the
scheduler scheduled, batch preparation (input ids, positions, slot mapping, block tables),
the merge of item embeddings into placeholder rows (`models/interfaces.py`),
the decoder forward on the paged cache, the LM head on the last positions and the sampler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mmkit.config import EngineConfig
from mmkit.engine.scheduler import ScheduledSeq, SchedulerOutput
from mmkit.errors import RequestError
from mmkit.layers.attention import AttentionMetadata, PrefillChunk, build_decode_metadata
from mmkit.layers.sampler import Sampler, SamplerOutput, SamplingRow
from mmkit.models.interfaces import EmbedSlice, merge_multimodal_embeddings, placeholder_slices, uses_mrope
from mmkit.models.registry import get_model_class
from mmkit.worker.encoder_cache import EncoderCache
from mmkit.worker.kv_cache import allocate_kv_caches, num_blocks_for


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the scheduled chunks that reached the end of their sequence."""

    sampled: list[ScheduledSeq]  # in the order of the sampler rows
    sampler_output: SamplerOutput | None
    # Rows of `sampler_output` per sampled chunk: n rows for a prompt that forks n samples.
    row_counts: list[int]
    prompt_logprobs: dict[str, torch.Tensor]  # request_id -> [chunk_len, vocab] logprobs


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, config: EngineConfig, input_processor) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.dtype = mc.dtype
        self.block_size = config.cache.block_size
        self.input_processor = input_processor
        model_cls = get_model_class(mc.architecture)
        max_positions = max(mc.max_model_len, getattr(mc.hf_config.get_text_config(), "max_position_embeddings", 0) or 0)
        with _default_dtype(torch.float32), torch.device(self.device):
            model = model_cls(mc.hf_config, max_positions)
        model.load_checkpoint(Path(mc.path))
        self.model = model.to(dtype=self.dtype).eval()
        self.model.prepare_for_inference()
        self.uses_mrope = uses_mrope(self.model)
        self.num_blocks = num_blocks_for(mc, config.cache, config.scheduler.max_num_seqs)
        self.kv_caches = allocate_kv_caches(mc, self.num_blocks, self.block_size)
        self.sampler = Sampler()
        self.encoder_cache = EncoderCache(config.cache.encoder_cache_memory)
        self.num_vision_calls = 0  # images encoded by the vision tower (for tests/metrics)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._run_encoder(sched)
        self._copy_blocks(sched.block_copies)
        # Decode tokens (chunks of one token) first, then prefill chunks.
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, slots, meta = self._prepare(order)
        if self.uses_mrope:
            positions = self._mrope_positions(order)
        embeds = self.model.embed_tokens(input_ids)
        self._merge_multimodal(order, embeds)
        hidden = self.model(embeds, positions, self.kv_caches, meta)
        # Logits only for the last position of chunks that complete their sequence.
        sampled, rows, row_counts, last_rows = [], [], [], []
        row = 0
        prompt_lp: dict[str, torch.Tensor] = {}
        for s in order:
            group = s.seq.group
            if group.params.prompt_logprobs is not None and s.seq.num_output_tokens == 0 and s.seq.index == 0:
                prompt_lp[group.request_id] = self._chunk_logprobs(hidden[row:row + s.num_new_tokens])
            row += s.num_new_tokens
            if not s.samples:
                continue
            copies = 1 + s.seq.num_pending_forks
            sampled.append(s)
            row_counts.append(copies)
            last_rows.extend([row - 1] * copies)
            rows.extend(self._sampling_rows(s, copies))
        if not sampled:
            return ModelRunnerOutput([], None, [], prompt_lp)
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        return ModelRunnerOutput(sampled, self.sampler(logits, rows), row_counts, prompt_lp)

    def _chunk_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).log_softmax(dim=-1)

    def _sampling_rows(self, s: ScheduledSeq, copies: int) -> list[SamplingRow]:
        group = s.seq.group
        params = group.params
        # NOTE: only penalties and min_tokens read the output ids; skip the O(length) copy
        # in the decode loop for every other request.
        output_ids = s.seq.output_token_ids if (params.has_penalties or params.min_tokens) else []
        # NOTE: pending forks (n > 1) draw their first token from the same logits row and,
        # not yet forked, share the parent's grammar state (all are at its start).
        structured = s.seq.structured
        rows = [SamplingRow(params, s.seq.generator, group.prompt_token_ids, output_ids, structured)]
        for child in group.pending_forks[: copies - 1]:
            rows.append(SamplingRow(params, child.generator, group.prompt_token_ids, output_ids, structured))
        return rows

    # ------------------------------------------------------------------ batch preparation
    def _prepare(self, order: list[ScheduledSeq]):
        """Flat step inputs. Built from Python ints and turned into tensors once per step
        (no per-sequence tensor ops): decode rows cost O(1) each, whatever their length."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for s in order:
            seq = s.seq
            table = seq.block_table
            start, end = s.start, s.end
            if end - start == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(end)
                continue
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            prefills.append(PrefillChunk(len(ids) - (end - start), end - start, end,
                                         torch.tensor(table, dtype=torch.long).to(self.device)))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=_to_device(slots, dev), prefills=prefills)
        if decode_tables:
            build_decode_metadata(meta, decode_tables, decode_lens, bs, dev)
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
            try:
                inputs = self.input_processor.mm_item_inputs(e.item)
            except Exception as exc:  # noqa: BLE001 - attributed to the one request
                raise RequestError([e.request_id], f"request {e.request_id!r}: image processing failed: {exc}") from exc
            to_encode.append(e)
            item_inputs.append({k: v.to(self.device) for k, v in inputs.items()})
        if item_inputs:
            embeds = self.model.embed_multimodal(item_inputs)  # one [num_tokens_i, hidden] per item
            self.num_vision_calls += len(item_inputs)
            fresh.update((e.key, emb) for e, emb in zip(to_encode, embeds))
        for e in sched.encoder_inputs:
            got = fresh[e.key].shape[0]
            if got != e.num_tokens:
                error = ValueError(f"request {e.request_id!r}: an image produced {got} embedding rows but its "
                                   f"placeholder range has {e.num_tokens} tokens; refusing to misalign them")
                raise RequestError([e.request_id], str(error)) from error
        for key, value in fresh.items():
            store.put(key, value)

    def _merge_multimodal(self, order: list[ScheduledSeq], embeds: torch.Tensor) -> None:
        """Scatter cached item embeddings into the placeholder rows this step computes."""
        items: list[torch.Tensor] = []
        index: dict[str, int] = {}
        slices: list[EmbedSlice] = []
        row = 0
        for s in order:
            group = s.seq.group
            ranges = group.processed.placeholder_ranges
            if ranges:
                for sl in placeholder_slices(ranges, s.start, s.end, row):
                    key = group.encoder_keys[sl.item]
                    if key not in index:
                        value = self.encoder_cache.get(key)
                        if value is None:  # pragma: no cover - the scheduler's invariant
                            raise RuntimeError(f"request {group.request_id!r}: encoder cache entry {key!r} missing")
                        index[key] = len(items)
                        items.append(value)
                    slices.append(replace(sl, item=index[key]))
            row += s.num_new_tokens
        merge_multimodal_embeddings(embeds, items, slices)

    def _mrope_positions(self, order: list[ScheduledSeq]) -> torch.Tensor:
        """[3, num_tokens] positions for a `SupportsMRoPE` model: the processor's rows for
        prompt tokens, index + delta (in all three rows) for generated ones."""
        parts = []
        for s in order:
            processed = s.seq.group.processed
            table = processed.mrope_positions  # [3, num_prompt_tokens]
            num_prompt = table.shape[1] if table is not None else 0
            lo, hi = s.start, s.end
            if lo < num_prompt:
                parts.append(table[:, lo:min(hi, num_prompt)])
            if hi > num_prompt:
                gen = torch.arange(max(lo, num_prompt), hi) + processed.mrope_position_delta
                parts.append(gen.expand(3, -1))
        return torch.cat(parts, dim=1).to(self.device)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:  # [kv_heads, num_blocks, block_size, head_dim]
            k_cache[:, dst] = k_cache[:, src]
            v_cache[:, dst] = v_cache[:, src]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
