"""ModelRunner: turns one `SchedulerOutput` into a forward pass and sampled tokens.

`execute_model` is the one call per engine step that runs the model: batch preparation
(input ids, positions, slot mapping, block tables), image encoding and merging on prefill,
the decoder forward on the paged cache, the LM head on the last positions and the sampler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mmkit.config import EngineConfig
from mmkit.engine.scheduler import ScheduledSeq, SchedulerOutput
from mmkit.engine.sequence import SequenceGroup
from mmkit.errors import RequestError
from mmkit.layers.attention import AttentionMetadata, PrefillChunk, build_decode_metadata
from mmkit.layers.sampler import Sampler, SamplerOutput, SamplingRow
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
        # The rotary table stays float32 (cast per use), like transformers.
        self.model.language_model.rotary.float()
        if hasattr(self.model, "prepare_for_inference"):
            self.model.prepare_for_inference()
        self.num_blocks = num_blocks_for(mc, config.cache, config.scheduler.max_num_seqs)
        self.kv_caches = allocate_kv_caches(mc, self.num_blocks, self.block_size)
        self.sampler = Sampler()
        self.encoder_cache = EncoderCache(config.cache.encoder_cache_memory)
        self.num_vision_calls = 0  # images encoded by the vision tower (for tests/metrics)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._copy_blocks(sched.block_copies)
        # Decode tokens (chunks of one token) first, then prefill chunks.
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, slots, meta = self._prepare(order)
        embeds = self.model.embed_tokens(input_ids)
        self._merge_images(order, embeds)
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

    # ------------------------------------------------------------------ images
    def _merge_images(self, order: list[ScheduledSeq], embeds: torch.Tensor) -> None:
        """Scatter vision embeddings into the placeholder rows covered by this step."""
        needs = [s for s in order if _overlaps_images(s)]
        if not needs:
            return
        self._encode_missing([s.seq.group for s in needs])
        dst_rows: list[torch.Tensor] = []
        src_rows: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        base_row = 0
        src_base = 0
        for s in order:
            if s in needs:
                group = s.seq.group
                image_base = 0
                for offset, length in group.processed.placeholder_ranges:
                    lo, hi = max(s.start, offset), min(s.end, offset + length)
                    if lo < hi:
                        dst_rows.append(torch.arange(lo - s.start, hi - s.start) + base_row)
                        src_rows.append(torch.arange(lo - offset, hi - offset) + image_base + src_base)
                    image_base += length
                sources.append(group.image_embeds)
                src_base += group.image_embeds.shape[0]
            base_row += s.num_new_tokens
        if dst_rows:
            source = torch.cat(sources)
            dst = torch.cat(dst_rows).to(self.device)
            src = torch.cat(src_rows).to(self.device)
            embeds.index_copy_(0, dst, source[src].to(embeds.dtype))

    def _encode_missing(self, groups: list[SequenceGroup]) -> None:
        """Fill `group.image_embeds` for groups about to prefill image tokens.

        Identical images (same content hash) are encoded once per step and, through the
        encoder cache, once across steps and calls; all misses of a step go through the
        vision tower together.
        """
        cache = self.encoder_cache
        todo: dict[str, object] = {}  # content hash (or unique key) -> ImageItem to encode
        plans: list[tuple[SequenceGroup, list[str]]] = []
        for g in dict.fromkeys(groups):  # unique, in order
            if g.image_embeds is not None:
                continue
            if g.processed.image_embeds is not None:
                g.image_embeds = g.processed.image_embeds.to(self.device, self.dtype).flatten(0, 1)
                self._check_count(g)
                continue
            keys = g.get_image_hashes() if cache.enabled else [f"{g.request_id}/{i}" for i in range(len(g.processed.images))]
            for key, item in zip(keys, g.processed.images):
                if cache.get(key) is not None or key in todo:
                    cache.num_hits += 1
                else:
                    cache.num_misses += 1
                    todo[key] = (g, item)
            plans.append((g, keys))
        fresh = self._encode(todo)
        for g, keys in plans:
            parts = [fresh[k] if k in fresh else cache.get(k) for k in keys]
            g.image_embeds = torch.cat(parts)  # [num_images * image_seq_length, hidden]
            self._check_count(g)

    def _encode(self, todo: dict) -> dict[str, torch.Tensor]:
        if not todo:
            return {}
        pixel_values = []
        for g, item in todo.values():
            try:
                pixel_values.append(self.input_processor.pixel_values([item]))
            except Exception as exc:  # noqa: BLE001 - attributed to the one request
                raise RequestError([g.request_id], f"request {g.request_id!r}: image processing failed: {exc}") from exc
        batch = torch.cat(pixel_values).to(self.device, self.dtype)
        features = self.model.encode_images(batch)  # [num_images, image_seq_length, hidden]
        self.num_vision_calls += batch.shape[0]
        fresh = {}
        for key, feats in zip(todo, features):
            fresh[key] = feats
            self.encoder_cache.put(key, feats)
        return fresh

    @staticmethod
    def _check_count(g: SequenceGroup) -> None:
        expected = sum(length for _, length in g.processed.placeholder_ranges)
        if g.image_embeds.shape[0] != expected:
            got = g.image_embeds.shape[0]
            g.image_embeds = None
            raise ValueError(
                f"request {g.request_id!r}: the images produced {got} embedding rows but the prompt has "
                f"{expected} image placeholder tokens; refusing to misalign them"
            )

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


def _overlaps_images(s: ScheduledSeq) -> bool:
    for offset, length in s.seq.group.processed.placeholder_ranges:
        if offset < s.end and s.start < offset + length:
            return True
    return False
