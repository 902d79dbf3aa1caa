"""Input processing for the transformers backend (`model_impl="transformers"`): the
checkpoint's own AutoProcessor does everything a family processor would.

Up front (cheap, the whole call validated before anything is added): each image's replacement
text is what the processor writes for a blank image of its size and options
(`processors/replacements.py`, cached by size); the prompt is expanded by the processor's own
`get_text_with_replacements` (a token-id prompt by `expand_token_ids`). An item's placeholder
range is the tokens of its replacement; its feature rows are the positions in that span that
hold the processor's image token (the model's `get_image_features` rows go there, the span's
other tokens keep their own embeddings: `models/transformers_backend/model.py`). No count
helper and no formula: only what the processor wrote. 3-D rotary positions come from the
model's own `get_rope_index` (on a meta-device instance of its class: no weights).

When the item is scheduled, the same processor call on its pixels gives its model inputs
(`pixel_values`, `image_grid_thw`, `image_sizes`, ... whatever the processor returns) and must
write the same number of image tokens (never a silent misalignment).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from mmkit.models.transformers_backend.model import FEATURE_MASK_KEY, SPAN_IDS_KEY, rope_index_owner
from mmkit.models.transformers_backend.qualify import transformers_class
from mmkit.models.transformers_backend.quirks import quirks_of
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.base import BaseInputProcessor, ProcessedPrompt
from mmkit.processors.replacements import ReplacementProbe, call_processor, expand_text, expand_token_ids
from mmkit.processors.spans import SpanItem, checked_token_ids

# Processor outputs that are the text, not an item's model inputs.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "text_replacement_offsets")


class TransformersInputProcessor(BaseInputProcessor):
    """The `InputProcessor` of the transformers backend (images; see the module docstring).

    Its processor options are whatever the checkpoint's own processor takes: any dict is passed
    through (transformers checks the keys it knows)."""

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)
        self.architecture = self.name
        self.load_hf_processor(tokenizer_path)
        self.chat_template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        image_token = getattr(self.hf_processor, "image_token", None)
        # The token whose positions the model's features fill: the one the model's own merge
        # looks for (its config's image token id), else the processor's.
        self.image_token_id = model_config.image_token_id
        if self.image_token_id is None:
            self.image_token_id = getattr(self.hf_processor, "image_token_id", None)
        if self.image_token_id is None and image_token is not None:
            self.image_token_id = self.tokenizer.convert_tokens_to_ids(image_token)
        self.bidirectional = quirks_of(model_config.hf_config).bidirectional
        self.probe = ReplacementProbe(self.hf_processor) if image_token is not None else None
        self._rope_owner: Any = None  # a meta-device instance with get_rope_index, built on first use
        self.has_rope_index = model_config.capabilities.uses_mrope  # the model declares it

    def check_mm_processor_kwargs(self, where: str, kwargs: Any) -> dict[str, Any]:
        """Any dict: the checkpoint's processor takes its own options."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"{where}: got {type(kwargs).__name__}; expected a dict")
        return dict(kwargs)

    # ------------------------------------------------------------------ up front (cheap)
    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        where = f"inputs[{parsed.index}]"
        if parsed.image_embeds is not None:
            raise ValueError(f"{where}.multi_modal_data: image embeddings are not supported with "
                             f"model_impl='transformers' ({self.architecture}); pass images")
        if parsed.video_data is not None:
            raise ValueError(f"{where}.multi_modal_data: videos are not supported with model_impl='transformers' "
                             f"({self.architecture}); pass images")
        kwargs = self.request_options(where, parsed)
        images = list(parsed.images)
        self.check_item_counts(where, {"image": len(images)})
        if images and self.probe is None:
            raise ValueError(f"{where}.multi_modal_data: {self.architecture}'s processor has no image token; "
                             "it takes no images")
        wheres = [f"{where}.multi_modal_data[{i}]" for i in range(len(images))]
        reps = [self.probe.replacement("image", item.width, item.height, 1, kwargs, at)
                for at, item in zip(wheres, images)] if images else []
        if parsed.prompt is not None:
            if self.probe is None:
                ids, ranges, order = list(self.tokenizer(parsed.prompt).input_ids), [], []
            else:
                exp = expand_text(self.hf_processor, self.tokenizer, where,
                                  processor_text_layout(self.hf_processor, parsed.prompt, len(images)), {"image": reps})
                ids, ranges, order = exp.token_ids, exp.ranges, exp.order
        else:
            ids = checked_token_ids(where, parsed.prompt_token_ids, self.vocab_size)
            ranges, order = [], []
            if self.probe is not None:
                exp = expand_token_ids(self.hf_processor, self.tokenizer, where, ids, {"image": reps})
                ids, ranges, order = exp.token_ids, exp.ranges, exp.order
        items: list[SpanItem] = []
        for (_, k), rng in zip(order, ranges):
            span = ids[rng.offset:rng.offset + rng.length]
            if not any(t == self.image_token_id for t in span):
                raise ValueError(f"{wheres[k]}: the processor wrote no image token for this image")
            items.append(SpanItem("image", [images[k]], span, dict(kwargs), wheres[k]))
        positions, delta = self._rope_positions(where, ids, ranges, [reps[k] for _, k in order])
        return ProcessedPrompt(index=parsed.index, prompt=parsed.prompt, prompt_token_ids=ids,
                               placeholder_ranges=[PlaceholderRange(*r) for r in ranges], images=items,
                               mrope_positions=positions, mrope_position_delta=delta, mm_processor_kwargs=kwargs,
                               bidirectional_ranges=self._bidirectional_ranges(ids, ranges))

    def _bidirectional_ranges(self, ids: list[int], ranges) -> list[PlaceholderRange]:
        """The spans the model's own mask opens both ways (models/transformers_backend/quirks.py)."""
        if self.bidirectional == "prompt":
            # Only a prompt the processor laid out (it writes token_type_ids there); a token-id
            # prompt without images reaches transformers' forward without them: causal.
            return [PlaceholderRange(0, len(ids))] if ranges else []
        if self.bidirectional != "image_runs":
            return []
        runs: list[PlaceholderRange] = []
        for off, n in ranges:
            k = off
            while k < off + n:
                if ids[k] != self.image_token_id:
                    k += 1
                    continue
                start = k
                while k < off + n and ids[k] == self.image_token_id:
                    k += 1
                runs.append(PlaceholderRange(start, k - start))
        return runs

    def _rope_positions(self, where: str, ids: list[int], ranges, reps) -> tuple[torch.Tensor | None, int]:
        """The model's own 3-D rotary positions ([3, num_tokens], delta), or (None, 0)."""
        if not self.has_rope_index:
            return None, 0
        owner = self._rope_index_owner()
        input_ids = torch.tensor([ids], dtype=torch.long)
        token_types = torch.zeros_like(input_ids, dtype=torch.int32)
        for off, n in ranges:
            span = input_ids[0, off:off + n]
            token_types[0, off:off + n] = (span == self.image_token_id).to(torch.int32)
        grids = [r.outputs.get("image_grid_thw") for r in reps]
        kwargs: dict[str, Any] = {"input_ids": input_ids, "mm_token_type_ids": token_types,
                                  "attention_mask": torch.ones_like(input_ids)}
        if grids and all(g is not None for g in grids):
            kwargs["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        accepted = inspect.signature(owner.get_rope_index).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        position_ids, deltas = owner.get_rope_index(**kwargs)
        return position_ids[:, 0, :].to(torch.long).clone(), int(torch.as_tensor(deltas).reshape(-1)[0])

    def _rope_index_owner(self) -> Any:
        if self._rope_owner is None:
            cls = transformers_class(self.architecture)
            with torch.device("meta"):
                self._rope_owner = rope_index_owner(cls(self.model_config.hf_config))
        return self._rope_owner

    # ------------------------------------------------------------------ at scheduling time
    def mm_item_inputs(self, item: SpanItem) -> MultiModalKwargs:
        """The processor on the item's pixels: its model inputs, plus the span and its feature
        mask (which rows the model's features fill)."""
        frames = [f.to_pil().convert("RGB") for f in item.frames]
        _, out = call_processor(self.hf_processor, "image", frames, item.options, item.where)
        span = torch.tensor(item.span_ids, dtype=torch.long)
        mask = span == self.image_token_id
        written = int((out["input_ids"] == self.image_token_id).sum())
        if written != int(mask.sum()):
            raise ValueError(f"{item.where}: the processor wrote {written} image tokens for the image's pixels "
                             f"where {int(mask.sum())} were predicted from its size; refusing to misalign them")
        inputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and not k.startswith(_TEXT_KEYS)}
        inputs[SPAN_IDS_KEY] = span
        inputs[FEATURE_MASK_KEY] = mask
        return inputs

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(token_ids, **kwargs)


def processor_text_layout(hf_processor: Any, prompt: str, num_images: int) -> str:
    """The prompt as the processor's own `__call__` lays it out before expanding placeholders
    (PaliGemma puts BOS after the images and a newline at the end), through its
    `prepare_inputs_layout` when the class overrides it; the prompt unchanged otherwise."""
    from transformers.processing_utils import ProcessorMixin

    layout = getattr(type(hf_processor), "prepare_inputs_layout", None)
    if not num_images or layout is None or layout is getattr(ProcessorMixin, "prepare_inputs_layout", None):
        return prompt
    from PIL import Image

    blank = [Image.new("RGB", (1, 1))] * num_images  # the layout reads only how many images there are
    _, text, *_ = hf_processor.prepare_inputs_layout(images=[blank], text=[prompt])
    return text[0] if isinstance(text, (list, tuple)) else text
