"""What a multimodal model family implements so the engine can run it unchanged.

A family is two classes and one `ModelRegistry.register_model` line per architecture: a
model class in `models/<family>.py` that implements `SupportsMultiModal` (and `SupportsMRoPE`
for 3-D rotary positions) and declares what generic code needs (`check_config`,
`get_sliding_window`, `get_image_seq_length`), and an input processor in
`processors/<family>.py` (`processors/base.py`: its modalities, its `mm_processor_kwargs`
checks). The engine, scheduler
and runner never look at a family's tensors: they move

- placeholder ranges (`PlaceholderRange`, decided by the processor from
  `get_num_placeholder_tokens`) with each request,
- one `MultiModalKwargs` dict per item (the processor's `mm_item_inputs(item)`, built when
  the scheduler schedules the item's encoding) into `embed_multimodal`, and
- the item embeddings it returns into the placeholder rows of a step, always through
  `merge_multimodal_embeddings` (the one merge; it handles chunked prefill).

Extra position rows (M-RoPE) are data computed by the processor when a request is added
(`ProcessedPrompt.mrope_positions`, `[3, num_prompt_tokens]`, and `mrope_position_delta`);
the runner slices them per step and passes `positions` of shape `[3, num_tokens]` to
`forward` (generated token at index p gets position `p + delta` in all three rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

# The request-carried types live in mmkit/multimodal/inputs.py; re-exported for the families.
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange  # noqa: F401 (re-export)


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A decoder model that takes item embeddings (images) merged into its token embeddings.

    Called by the runner, in this order per step: `embed_multimodal` for the items the
    scheduler scheduled for encoding, `embed_tokens`, `merge_multimodal_embeddings`,
    `forward`, `compute_logits`.

    Optional declarations generic code reads (classmethods taking the checkpoint's HF config;
    `DecoderLMMixin` gives the defaults): `check_config(hf_config)` raises ValueError for a
    config the family cannot compute exactly (when the architecture is resolved);
    `get_sliding_window(hf_config)` -> the decoder's attention window in tokens or None;
    `get_image_seq_length(hf_config)` -> placeholder tokens per image when fixed, else None.
    """

    supports_multimodal: ClassVar[bool]

    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Placeholder tokens (= embedding rows) of one image of `image_size` (width, height).

        Used by the family's processor when it expands placeholders; may depend on the
        size (LLaVA-NeXT anyres, Qwen2-VL) or be a constant (LLaVA-1.5)."""
        ...

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """One tensor per item, `[num_placeholder_tokens_i, text_hidden]` in the model dtype.

        Items may have different token counts; the model batches them as it likes."""
        ...

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]."""
        ...

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden]; positions [num_tokens], or [3, num_tokens] for
        a `SupportsMRoPE` model -> hidden states [num_tokens, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] (model dtype or float32; the runner and
        sampler cast to float32 where they transform logits)."""
        ...

    def load_checkpoint(self, path: Any, dtype: Any = None, device: Any = None) -> None:
        """Load the weights; parameters built on the meta device (`meta_init.meta_parameters`)
        are created in `dtype` on `device`."""
        ...

    def prepare_for_inference(self) -> Any:
        """Called once after the final `.to(dtype)`: pack weights, keep tables in float32."""
        ...


@runtime_checkable
class SupportsMRoPE(Protocol):
    """A model whose rotary positions have three rows (temporal, height, width).

    The processor fills `ProcessedPrompt.mrope_positions` ([3, num_prompt_tokens], long) and
    `mrope_position_delta` (int: a generated token at index p has position p + delta) when the
    request is added, e.g. with a classmethod of the model; `forward` then gets `[3, T]`."""

    uses_mrope: ClassVar[bool]


@runtime_checkable
class SupportsDeepStack(Protocol):
    """A model that adds vision features to the hidden states of its first decoder layers
    (Qwen3-VL's DeepStack). Its item embeddings are `[num_tokens, (1 + deepstack_num_layers) *
    hidden]`: the embedding, then one feature set per layer. The runner widens a step's token
    embeddings to that width (zeros) whenever the step merges items, so `forward` gets
    `[num_tokens, hidden]` or the wide form, and splits it."""

    deepstack_num_layers: int


def deepstack_num_layers(model: Any) -> int:
    return int(getattr(model, "deepstack_num_layers", 0))


def supports_multimodal(model: Any) -> bool:
    return bool(getattr(model, "supports_multimodal", False))


def uses_mrope(model: Any) -> bool:
    return bool(getattr(model, "uses_mrope", False))


@dataclass(frozen=True)
class EmbedSlice:
    """Rows [src_start, src_start + length) of item `item`'s embedding go to rows
    [dst_start, dst_start + length) of the step's flat token embeddings."""

    item: int
    dst_start: int
    src_start: int
    length: int


def placeholder_slices(ranges: Sequence[tuple[int, int]], start: int, end: int, step_row: int,
                       item_ids: Sequence[int] | None = None) -> list[EmbedSlice]:
    """The slices of a chunk that computes prompt positions [start, end), whose first token
    is row `step_row` of the step. `item_ids[i]` names range i's embedding in the list later
    given to `merge_multimodal_embeddings` (default: i). A chunk may cover part of an item
    (chunked prefill, or a prefix-cache hit that ends inside an image)."""
    slices = []
    for i, (offset, length) in enumerate(ranges):
        lo, hi = max(start, offset), min(end, offset + length)
        if lo < hi:
            item = item_ids[i] if item_ids is not None else i
            slices.append(EmbedSlice(item, step_row + lo - start, lo - offset, hi - lo))
    return slices


def merge_multimodal_embeddings(inputs_embeds: torch.Tensor, item_embeds: Sequence[torch.Tensor],
                                slices: Sequence[EmbedSlice]) -> torch.Tensor:
    """Scatter item embedding rows into `inputs_embeds` ([num_tokens, hidden]) in place.

    The one merge every family uses: placeholder positions come from the processor's ranges,
    never from `input_ids == image_token_id` (a generated image token id is an ordinary token)."""
    if not slices:
        return inputs_embeds
    dst = torch.cat([torch.arange(s.dst_start, s.dst_start + s.length) for s in slices])
    rows = [item_embeds[s.item][s.src_start:s.src_start + s.length] for s in slices]
    source = rows[0] if len(rows) == 1 else torch.cat(rows)
    inputs_embeds.index_copy_(0, dst.to(inputs_embeds.device), source.to(inputs_embeds.dtype))
    return inputs_embeds


def decoder_sliding_window(text_config: Any) -> int | None:
    """The attention window a decoder config applies (the way transformers decides it), or None:
    `sliding_window`, unless `layer_types` marks no layer "sliding_attention" or the config
    switches it off with `use_sliding_window=False`."""
    window = getattr(text_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:  # only layers marked "sliding_attention" slide
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(text_config, "use_sliding_window", True) is False:
        return None
    return int(window)


class DecoderLMMixin:
    """The text side every family shares: `embed_tokens`, `forward` and `compute_logits`
    delegated to the family's paged decoder (`self.language_model`) and `self.lm_head`;
    and the default declarations generic code reads (`mmkit/config.py`)."""

    @classmethod
    def get_sliding_window(cls, hf_config: Any) -> int | None:
        """The decoder's sliding attention window in tokens, or None (full attention)."""
        return decoder_sliding_window(hf_config.get_text_config())

    @classmethod
    def get_image_seq_length(cls, hf_config: Any) -> int | None:
        """Placeholder tokens of every image when the count is fixed; None when it depends on
        the image (the processor asks `get_num_placeholder_tokens` per item)."""
        return None

    def load_checkpoint(self, path: Any, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> None:
        """Meta parameters (see models/meta_init.py) are created in `dtype` on `device`."""
        from mmkit.models.weight_utils import load_vlm_checkpoint

        load_vlm_checkpoint(self, path, dtype, device)

    def prepare_for_inference(self) -> int:
        """After the final `.to(dtype, device)`: pre-pack bf16 CPU matmul weights (decoder and
        LM head). Returns the number of packed linears (0 on CUDA and in float32)."""
        from mmkit.models.llama import pack_linears

        self.language_model.rotary.float()  # the table stays float32 (cast per use), like HF
        # The decoder's weights live only in packed form (their row-major copies are dropped);
        # the LM head keeps its weight: it may be the token embedding (tied).
        return pack_linears(self.language_model, release_weights=True) + pack_linears(self.lm_head)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        # positions: [num_tokens], or [3, num_tokens] (temporal, height, width) for M-RoPE
        return self.language_model(inputs_embeds, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] (last positions only) -> [num_rows, vocab] in the model's
        # dtype: the sampler casts to float32 only where it transforms them (greedy argmax
        # reads bf16 directly; a [128, vocab] float copy per step cost as much as sampling).
        return self.lm_head(hidden)
