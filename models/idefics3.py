"""Idefics3 and SmolVLM / SmolVLM2: transformers' SigLIP-style vision transformer and
pixel-shuffle connector (each tile's patch grid folded `scale_factor`^2 -> 1, then one
linear) in front of mmkit's paged Llama decoder (`text_model`).

An image is split into tiles of the checkpoint's `max_image_size` plus a global view (or is
the global view alone); every view gives `image_seq_len` tokens. The processor writes the
whole layout (`<fake_token_around_image><row_i_col_j><image>*N ... <global-img>...`) as one
span per image (a SmolVLM video: one span over every frame and its timestamp text), and the
model returns one row per span token (`models/span_embeds.py`). The features are transformers'
own `get_image_features` run on mmkit's modules, so the tile handling is the reference's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from mmkit.models.interfaces import DecoderLMMixin, MultiModalKwargs
from mmkit.models.llama import Linear, LlamaModel
from mmkit.models.span_embeds import span_embeddings
from mmkit.models.registry import check_text_model, ties_word_embeddings

SUPPORTED_TEXT_MODELS = ("llama",)


class Idefics3ForConditionalGeneration(DecoderLMMixin, nn.Module):
    """Idefics3 (`SupportsMultiModal`): tiles + global view per image, Llama decoder."""

    supports_multimodal: ClassVar[bool] = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        text = config.text_config
        self.check_config(config)
        vision_cls, connector_cls = self._hf_classes()[1:]
        self.config = config
        self.vision_model = vision_cls(config.vision_config)  # the public constructor; cast later
        self.connector = connector_cls(config)
        self.text_model = LlamaModel(text, max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """A Llama decoder (what every released checkpoint of the family has)."""
        check_text_model(cls.__name__, hf_config, SUPPORTED_TEXT_MODELS)

    @staticmethod
    def _hf_classes():
        """(transformers' base model, vision transformer, connector) of the family."""
        from transformers.models.idefics3 import modeling_idefics3 as m

        return m.Idefics3Model, m.Idefics3VisionTransformer, m.Idefics3Connector

    @property
    def language_model(self) -> LlamaModel:
        """The decoder under the name the shared code uses (transformers calls it `text_model`)."""
        return self.text_model

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def image_seq_len(cls, hf_config: Any) -> int:
        """Tokens per view: the patch grid shrunk by the pixel shuffle."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // hf_config.scale_factor ** 2

    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Image tokens (feature rows) of one image: `image_seq_len` per tile plus the global view.
        NOTE: the span the processor writes adds the layout tokens around them."""
        rows, cols = 0, 0
        if image_processor is not None:
            _, rows, cols = image_processor.get_number_of_image_patches(image_size[1], image_size[0], {})
        return cls.image_seq_len(hf_config) * (rows * cols + 1)

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [1, views, 3, S, S], "pixel_attention_mask": [1, views, S, S],
        "span_ids": [L]} -> one [L, hidden] tensor each (views of a video are its frames); an item of
        given embeddings is {"image_embeds": [views * image_seq_len, hidden], "span_ids": [L]}."""
        base_cls = self._hf_classes()[0]
        owner = SimpleNamespace(config=self.config, vision_model=self.vision_model, connector=self.connector,
                                dtype=self.vision_model.dtype)
        out = []
        for item in items:
            if "image_embeds" in item:  # given by the user: [views * image_seq_len, hidden]
                out.append(span_embeddings(self.text_model.embed_tokens, item["span_ids"],
                                           self.config.image_token_id, item["image_embeds"]))
                continue
            features = base_cls.get_image_features(owner, pixel_values=item["pixel_values"],
                                                   pixel_attention_mask=item["pixel_attention_mask"],
                                                   return_dict=True).pooler_output
            features = torch.cat(list(features))  # [views * image_seq_len, hidden]
            out.append(span_embeddings(self.text_model.embed_tokens, item["span_ids"], self.config.image_token_id,
                                       features))
        return out


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM / SmolVLM2: Idefics3's layout with SmolVLM's tower and connector; video frames
    are global views, each after its timestamp."""

    @staticmethod
    def _hf_classes():
        from transformers.models.smolvlm import modeling_smolvlm as m

        return m.SmolVLMModel, m.SmolVLMVisionTransformer, m.SmolVLMConnector
