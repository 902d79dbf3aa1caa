"""The typed result of input processing, carried by a request from `add_request` to the
runner, and what a family's input processor provides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol

import torch

from mmkit.multimodal.inputs import MultiModalKwargs, PlaceholderRange
from mmkit.multimodal.items import MultiModalItem
from mmkit.multimodal.parse import ParsedPrompt
from mmkit.processors.mm_kwargs import OptionRule, check_mm_processor_kwargs


@dataclass
class ProcessedPrompt:
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    # One range per item, in item order: the positions its embedding rows replace.
    placeholder_ranges: list[PlaceholderRange] = field(default_factory=list)
    # Every item (images, videos, spans) in placeholder order; the family builds them.
    images: list[MultiModalItem] = field(default_factory=list)
    # Embeddings given by the user, one [num_tokens_i, hidden] per item (a [N, L, hidden]
    # tensor is N items, or a list); they skip the vision tower. In a list, a None entry is an
    # item of `images` that mmkit encodes (a video beside given image embeddings).
    image_embeds: torch.Tensor | list[torch.Tensor | None] | None = None
    # M-RoPE models only (`ModelCapabilities.uses_mrope` in mmkit.models.interfaces):
    # [3, num_prompt_tokens] positions and the offset of generated tokens (position = index + delta).
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    # Processor options of this request (engine-wide ones merged with its own); part of its
    # items' content hashes, so other options never share cached embeddings or KV blocks.
    mm_processor_kwargs: dict = field(default_factory=dict)
    # Spans the decoder attends bidirectionally (Gemma 3: each run of image soft tokens), as
    # (offset, length); the scheduler computes each in one chunk, the attention reads them.
    bidirectional_ranges: list[PlaceholderRange] = field(default_factory=list)
    # The request's LoRA adapter (mmkit.lora.LoRARequest) or None; set by the engine.
    lora_request: Any = None


class InputProcessor(Protocol):
    """What the engine calls on a family's processor (`processors/<family>.py`).

    Built as `cls(model_config, tokenizer_path, limit_mm_per_prompt, mm_processor_kwargs)`;
    the constructor checks the engine-wide `mm_processor_kwargs` (ValueError naming the key and
    what the family accepts) and `process` checks a request's own, so generic code never knows
    a family's options."""

    # The modalities `process` accepts ("image", "video"); chat parsing reads it.
    supported_modalities: ClassVar[tuple[str, ...]]
    tokenizer: Any
    hf_processor: Any
    chat_template: str | None

    def process(self, parsed: ParsedPrompt) -> ProcessedPrompt:
        """Cheap and up front (every prompt of a call is validated before any is added):
        token ids with placeholders expanded, placeholder ranges, M-RoPE positions."""
        ...

    def mm_item_inputs(self, item: MultiModalItem) -> MultiModalKwargs:
        """The item's model inputs for `embed_multimodal`: run by the input stage
        (`mmkit/multimodal/stage.py`) on a prefetch worker while the request waits. A failure
        here fails that request alone."""
        ...


# Items per prompt when `limit_mm_per_prompt` does not say (vLLM's defaults differ per model;
# these are mmkit's since the first families).
DEFAULT_ITEM_LIMITS = {"image": 8, "video": 1}


class BaseInputProcessor:
    """What every family's processor shares, so a family's file holds its differences only:
    the engine-wide and per-request `mm_processor_kwargs` checks (against the family's declared
    `mm_processor_rules`), the per-prompt item limits, and loading the checkpoint's HF processor
    (local files only: nothing downloads at run time).

    Subclasses keep the constructor signature `get_input_processor` calls."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    # The family's processor options (vLLM's `mm_processor_kwargs`): key -> rule. Empty: it
    # takes none, and any given option is a ValueError naming the architecture.
    mm_processor_rules: ClassVar[Mapping[str, OptionRule]] = {}
    # A valid dict, shown when the options are not a dict.
    mm_processor_example: ClassVar[str] = "{}"

    def __init__(self, model_config, tokenizer_path: str, limit_mm_per_prompt: Mapping[str, int],
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        self.name = model_config.architecture
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.max_items = {m: int(limit_mm_per_prompt.get(m, n)) for m, n in DEFAULT_ITEM_LIMITS.items()}
        self.default_kwargs = self.check_mm_processor_kwargs("mm_processor_kwargs", mm_processor_kwargs)

    @property
    def max_images(self) -> int:
        return self.max_items["image"]

    def load_hf_processor(self, path: str) -> Any:
        """The checkpoint's AutoProcessor; sets `hf_processor`, `tokenizer`, `image_processor`,
        `video_processor` (a video family only) and `chat_template` from it."""
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.hf_processor = hf
        self.tokenizer = getattr(hf, "tokenizer", None) or hf  # a tokenizer-only checkpoint: itself
        self.image_processor = getattr(hf, "image_processor", None)
        if "video" in self.supported_modalities:
            self.video_processor = getattr(hf, "video_processor", None)
        self.chat_template = getattr(hf, "chat_template", None)
        return hf

    def check_mm_processor_kwargs(self, where: str, kwargs: Any) -> dict[str, Any]:
        """`kwargs` checked against the family's rules (None: no options)."""
        if not self.mm_processor_rules:
            if kwargs:
                raise ValueError(f"{where}: got {dict(kwargs) if isinstance(kwargs, Mapping) else kwargs!r}; "
                                 f"{self.name} takes no processor options")
            return {}
        return check_mm_processor_kwargs(where, kwargs, self.mm_processor_rules, self.mm_processor_example)

    def request_options(self, where: str, parsed: ParsedPrompt) -> dict[str, Any]:
        """The engine-wide options overridden by this request's own (checked)."""
        return {**self.default_kwargs,
                **self.check_mm_processor_kwargs(f"{where}.mm_processor_kwargs", parsed.mm_processor_kwargs)}

    def check_item_counts(self, where: str, counts: Mapping[str, int]) -> None:
        """A ValueError for the first modality with more items than `limit_mm_per_prompt` allows."""
        for modality, count in counts.items():
            if count > self.max_items[modality]:
                raise ValueError(f"{where}.multi_modal_data: got {count} {modality}s; expected at most "
                                 f"limit_mm_per_prompt['{modality}'] = {self.max_items[modality]}")
