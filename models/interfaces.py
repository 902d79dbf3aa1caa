"""What a multimodal model family implements so the engine can run it unchanged.

A family is two classes and one `ModelRegistry.register_model` line per architecture: a
model class in `models/<family>.py` that implements `SupportsMultiModal` and declares what
generic code needs ONCE, as a `ModelCapabilities` from its `get_capabilities(hf_config)`
classmethod (sliding layers, a fixed image token count, bidirectional spans, 3-D positions,
DeepStack columns, recurrent state; `DecoderLMMixin` gives the default, a family overrides
what differs), plus `check_config`; and an input processor in `processors/<family>.py`
(`processors/base.py`: its modalities, its `mm_processor_kwargs` checks). `mmkit/config.py`
keeps the declaration in `ModelConfig.capabilities`; the engine, scheduler, runner, KV cache
sizing, memory profile and CUDA graphs read it there, never from the model object or the HF
config. They never look at a family's tensors either: they move

- placeholder ranges (`PlaceholderRange`, decided by the processor from
  `get_num_placeholder_tokens`) with each request,
- one `MultiModalKwargs` dict per item (the processor's `mm_item_inputs(item)`, built when
  the scheduler schedules the item's encoding) into `embed_multimodal`, and
- the item embeddings it returns into the placeholder rows of a step, always through
  `merge_multimodal_embeddings` (the one merge; it handles chunked prefill).

Extra position rows (M-RoPE, `ModelCapabilities.uses_mrope`) are data computed by the
processor when a request is added (`ProcessedPrompt.mrope_positions`, `[3, num_prompt_tokens]`,
and `mrope_position_delta`); the runner slices them per step and passes `positions` of shape
`[3, num_tokens]` to `forward` (generated token at index p gets position `p + delta` in all
three rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

from mmkit.layers.sliding_window import kv_window, layer_windows
from mmkit.layers.state_spec import StateSpec

# The request-carried types live in mmkit/multimodal/inputs.py; re-exported for the families.
from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange  # noqa: F401 (re-export)


@dataclass(frozen=True)
class ModelCapabilities:
    """What generic code needs to know about a family for one checkpoint config, declared once
    by the model class (`get_capabilities(hf_config)`) and kept in `ModelConfig.capabilities`.

    A declaration is a promise about the family's own computation: a family that declares
    sliding windows applies them in its attention layers, one that declares `uses_mrope` reads
    `[3, T]` positions, and so on; generic code sizes and schedules from the declaration alone.
    """

    # One entry per decoder layer: its sliding attention window in tokens (the query at p sees
    # keys in (p - W, p]), None for a global layer. When every layer slides, the block manager
    # frees blocks out of the window; CUDA decode graphs build one mask per distinct window.
    layer_sliding_windows: tuple[int | None, ...] = ()
    # Placeholder tokens of every image when the count is fixed whatever the image (LLaVA-1.5);
    # None when it depends on the image (the processor asks `get_num_placeholder_tokens`).
    image_seq_length: int | None = None
    # The processor marks spans the decoder attends bidirectionally
    # (`ProcessedPrompt.bidirectional_ranges`: Gemma 3's image soft tokens, PaliGemma's prefix);
    # the scheduler never ends a chunk inside one and the attention opens the causal mask there.
    # A processor of a family without it setting ranges is a bug the engine reports.
    bidirectional_spans: bool = False
    # 3-D rotary positions (temporal, height, width): the runner passes `[3, num_tokens]`
    # positions from `ProcessedPrompt.mrope_positions` (decode steps then run eagerly on CUDA).
    uses_mrope: bool = False
    # Extra embedding columns (Qwen3-VL's DeepStack): item embeddings are
    # `[num_tokens, (1 + deepstack_num_layers) * hidden]`, the embedding then one feature set per
    # early decoder layer; the runner widens a merging step's token embeddings to that width
    # (zeros), and the engine sizes the encoder cache by it.
    deepstack_num_layers: int = 0
    # A hybrid decoder's per-request state (mmkit/layers/state_spec.py): its layers keep no KV,
    # the engine gives each running request a state slot, prefix caching and n > 1 are refused.
    state_spec: StateSpec | None = None

    @property
    def embed_width_factor(self) -> int:
        """Item embedding width in units of the hidden size."""
        return 1 + self.deepstack_num_layers

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides (KV blocks entirely before it can be freed), else None."""
        return kv_window(list(self.layer_sliding_windows))


def default_capabilities(hf_config: Any) -> ModelCapabilities:
    """What a plain decoder declares: the sliding layers its text config names (the way
    transformers reads them, mmkit/layers/sliding_window.py), nothing else."""
    return ModelCapabilities(layer_sliding_windows=tuple(layer_windows(hf_config.get_text_config())))


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A decoder model that takes item embeddings (images) merged into its token embeddings.

    Called by the runner, in this order per step: `embed_multimodal` for the items the
    scheduler scheduled for encoding, `embed_tokens`, `merge_multimodal_embeddings`,
    `forward`, `compute_logits`.

    Declarations generic code reads (classmethods taking the checkpoint's HF config;
    `DecoderLMMixin` gives the defaults): `get_capabilities(hf_config)` -> `ModelCapabilities`
    (read once, into `ModelConfig.capabilities`); `check_config(hf_config)` raises ValueError
    for a config the family cannot compute exactly (when the architecture is resolved).
    """

    supports_multimodal: ClassVar[bool]

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        """What generic code needs to know about this checkpoint (see `ModelCapabilities`)."""
        ...

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
        """inputs_embeds [num_tokens, hidden]; positions [num_tokens], or [3, num_tokens] when
        the family declares `uses_mrope`; inputs_embeds [num_tokens, factor * hidden] in a step
        that merged items of a family declaring DeepStack layers -> hidden [num_tokens, hidden]."""
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


class DecoderLMMixin:
    """The text side every family shares: `embed_tokens`, `forward` and `compute_logits`
    delegated to the family's paged decoder (`self.language_model`) and `self.lm_head`;
    and the default declarations generic code reads (`get_capabilities`, `check_config`)."""

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        """The default declaration (`default_capabilities`); a family overrides what differs,
        e.g. `dataclasses.replace(super().get_capabilities(hf_config), uses_mrope=True)`."""
        return default_capabilities(hf_config)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError for a config the family cannot compute exactly (default: accept)."""

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
