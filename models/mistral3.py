"""Mistral 3 (Mistral Small 3.x): transformers' Pixtral vision tower (2-D axial rotary over
each image's own patch grid, so images keep their size) and its projector (RMSNorm, the 2x2
patch merger, two linears), in front of mmkit's paged Mistral decoder (the Llama block).

An image of h x w merged patches takes the span `([IMG] * w + [IMG_BREAK]) * h` with the last
break replaced by `[IMG_END]` (PixtralProcessor's layout); the model returns one row per span
token (`models/span_embeds.py`). A decoder config with `sliding_window` slides in every layer:
the default capabilities declare it, and the block manager frees blocks out of the window.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
from torch import nn
from transformers import AutoModel

from mmkit.models.interfaces import DecoderLMMixin, MultiModalKwargs
from mmkit.models.llama import Linear, LlamaModel
from mmkit.models.span_embeds import span_embeddings
from mmkit.models.registry import check_text_model, ties_word_embeddings

SUPPORTED_TEXT_MODELS = ("mistral", "llama")


def merged_grid(hf_config: Any, image_size: tuple[int, int], image_processor: Any = None) -> tuple[int, int]:
    """(rows, columns) of merged patches of an image of `image_size` (width, height), as the
    Pixtral image processor resizes it (longest edge, patch multiples)."""
    import numpy as np
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    step = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
    size = dict(getattr(image_processor, "size", None) or {"longest_edge": hf_config.vision_config.image_size})
    longest = size.get("longest_edge") or max(size["height"], size["width"])
    width, height = image_size
    shape_only = np.broadcast_to(np.zeros(1, np.uint8), (height, width, 3))  # no pixels allocated
    h, w = get_resize_output_image_size(shape_only, size=(longest, longest), patch_size=(step, step),
                                        input_data_format=ChannelDimension.LAST)
    return h // step, w // step


class Mistral3ForConditionalGeneration(DecoderLMMixin, nn.Module):
    """Mistral 3 (`SupportsMultiModal`): per-image token counts from the image size."""

    supports_multimodal: ClassVar[bool] = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        text = config.text_config
        self.check_config(config)
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self.language_model = LlamaModel(text, max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """A Mistral / Llama decoder behind the Pixtral tower (what mmkit computes exactly)."""
        check_text_model(cls.__name__, hf_config, SUPPORTED_TEXT_MODELS)
        vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
        if vision_type != "pixtral":
            raise ValueError(f"model: {cls.__name__} with a {vision_type!r} vision tower is not supported; "
                             "expected 'pixtral'")

    # ------------------------------------------------------------------ loading
    def prepare_for_inference(self) -> int:
        # The tower's axial frequencies stay float32, as transformers keeps them (recomputed: the
        # engine's dtype cast rounded the buffer).
        rotary = self.vision_tower.patch_positional_embedding
        inv_freq = rotary.compute_axial_rope_parameters(self.config.vision_config)[0]
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
        return super().prepare_for_inference()

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Span tokens of one image: each of its `h` rows is `w` [IMG] tokens and one break/end."""
        h, w = merged_grid(hf_config, image_size, image_processor)
        return h * (w + 1)

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [1, 3, H, W], "image_sizes": [1, 2], "span_ids": [L]} -> [L, hidden] each;
        an item of given embeddings is {"image_embeds": [h * w, hidden], "span_ids": [L]}.

        NOTE: one tower call per image: Pixtral attends within an image only (transformers
        batches a prompt's images with a block-diagonal mask), so the features are the same."""
        dtype = self.vision_tower.dtype  # (the projector's weight may be quantized)
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        out = []
        for item in items:
            if "image_embeds" in item:  # given by the user: the projector's rows [h * w, text_hidden]
                out.append(span_embeddings(self.language_model.embed_tokens, item["span_ids"],
                                           self.config.image_token_id, item["image_embeds"]))
                continue
            sizes = item["image_sizes"]
            states = self.vision_tower(item["pixel_values"].to(dtype), image_sizes=sizes,
                                       output_hidden_states=True, return_dict=True).hidden_states
            selected = torch.cat([states[i] for i in layers], dim=-1).squeeze(0)  # [patches, vision_hidden]
            features = self.multi_modal_projector(selected, sizes)  # [h * w, text_hidden]
            out.append(span_embeddings(self.language_model.embed_tokens, item["span_ids"],
                                       self.config.image_token_id, features))
        return out
