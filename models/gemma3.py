"""Gemma 3 (google/gemma-3-4b-it, 12b, 27b): transformers' SigLIP tower and its
`Gemma3MultiModalProjector` (patch grid average-pooled to `mm_tokens_per_image`, (1 + w)
RMSNorm, one matrix) in front of mmkit's paged Gemma 3 decoder.

The decoder is the Qwen3 block (per-head q/k norm before the rotary) with Gemma's changes:
- every RMSNorm scales by (1 + w) in float32 and casts after (`GemmaRMSNorm`);
- token embeddings are multiplied by sqrt(hidden), rounded to the weight dtype first (as
  transformers does: 55.4256 becomes 55.5 in bf16);
- four norms per layer: input, post-attention (on the attention output, before the residual
  add), pre- and post-feed-forward; gelu-tanh MLP (`hidden_activation`);
- attention scale `query_pre_attn_scalar ** -0.5`;
- sliding layers (`layer_types`; a 4.x config's `sliding_window_pattern` is turned into them by
  `Gemma3TextConfig`) with their own rotary base (`rope_local_base_freq`), global layers with
  theirs and its scaling: `rope_parameters[layer_type]`, tabulated by transformers' own
  `Gemma3RotaryEmbedding`;
- `final_logit_softcapping` (logits = cap * tanh(logits / cap)) where configured, as vLLM and
  transformers' Gemma3ForCausalLM apply it (greedy ids are unchanged: tanh is monotonic).

Each image (and each pan-and-scan crop) gives `mm_tokens_per_image` soft tokens inside the
span Gemma3Processor writes (`\\n\\n<start_of_image><image_soft_token>*N<end_of_image>\\n\\n`, with
crops "Here is the original image ... and here are some crops ..."); the model returns one row
per span token (`models/span_embeds.py`), and the processor marks each run of soft tokens as a
bidirectional span (transformers' `token_type_ids` mask).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel

from mmkit.layers.attention import AttentionMetadata
from mmkit.layers.rotary import RotaryEmbedding, StepRope
from mmkit.layers.sliding_window import layer_windows
from mmkit.models.interfaces import DecoderLMMixin, ModelCapabilities, MultiModalKwargs
from mmkit.models.llama import Linear, LlamaMLP, LlamaModel
from mmkit.models.qwen3 import Qwen3Attention
from mmkit.models.registry import check_text_model, ties_word_embeddings
from mmkit.models.span_embeds import span_embeddings


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm arithmetic: normalise and scale by (1 + w) in float32, then cast."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is HF's `x * rsqrt(mean(x^2) + eps)` in one kernel (bit-identical in float32).
        h = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden), the scale rounded to the weight dtype (HF's
    Gemma3TextScaledWordEmbedding). Ids at or past the vocabulary (an out-of-vocabulary image
    token, whose rows the image features replace) embed as id 0, as transformers does."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = float(hidden_size) ** 0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.masked_fill(input_ids >= self.num_embeddings, 0)
        rows = super().forward(ids)
        return rows * torch.tensor(self.scale, dtype=torch.float32).to(rows.dtype)


class Gemma3Attention(Qwen3Attention):
    qk_norm_cls = GemmaRMSNorm

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]  # which rotary table the layer reads
        self.self_attn = Gemma3Attention(config)
        self.self_attn.sliding_window = layer_windows(config)[layer_idx]
        self.mlp = LlamaMLP(config, hidden_act=config.hidden_activation)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden]; the residual adds in HF's order (norm of the branch, then add).
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3TextModel(LlamaModel):
    """The Gemma 3 decoder stack without the LM head (HF's `Gemma3TextModel`); `fuse_weights`
    (q/k/v and gate/up) is LlamaModel's."""

    def __init__(self, config, max_positions: int) -> None:
        nn.Module.__init__(self)
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        self.config = config
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # One table per layer type: its base (local / global) and scaling, from transformers' module.
        hf_rotary = Gemma3RotaryEmbedding(config)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(config, max_positions, hf_rotary=functools.partial(hf_rotary, layer_type=kind))
            for kind in sorted(set(config.layer_types[:config.num_hidden_layers]))})

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        # inputs_embeds: [num_tokens, hidden] (already scaled); positions: [num_tokens]
        x = inputs_embeds
        ropes = {kind: rotary.for_positions(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes[layer.layer_type], kv_cache, meta)
        return self.norm(x)


class Gemma3ForConditionalGeneration(DecoderLMMixin, nn.Module):
    """Gemma 3 (`SupportsMultiModal`): SigLIP + projector, sliding/global Gemma 3 decoder."""

    supports_multimodal: ClassVar[bool] = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.check_config(config)
        text = config.text_config
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3TextModel(text, max_positions)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = ties_word_embeddings(config)
        self.final_logit_softcapping = getattr(text, "final_logit_softcapping", None)

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        """Sliding/global layers (the default reads them) and each run of image soft tokens
        attended bidirectionally (transformers' `token_type_ids` mask)."""
        return replace(super().get_capabilities(hf_config), bidirectional_spans=True)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """A Gemma 3 decoder (causal, no attention-logit capping) behind a SigLIP tower."""
        check_text_model(cls.__name__, hf_config, ("gemma3_text",))
        text = hf_config.get_text_config()
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError(f"model: {cls.__name__} with use_bidirectional_attention=True (an embedding model) "
                             "is not supported; mmkit runs causal Gemma 3 decoders")
        if getattr(text, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"model: {cls.__name__} with attn_logit_softcapping="
                             f"{text.attn_logit_softcapping} is not supported; expected None (as Gemma 3 releases)")
        vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
        if vision_type != "siglip_vision_model":
            raise ValueError(f"model: {cls.__name__} with a {vision_type!r} vision tower is not supported; "
                             "expected 'siglip_vision_model'")

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        """Soft tokens of one view (the image, or one pan-and-scan crop). NOTE: the span the
        processor writes adds the layout tokens and the crops' views."""
        return int(hf_config.mm_tokens_per_image)

    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """Items {"pixel_values": [views, 3, S, S] (the image, then its crops), "span_ids": [L]}
        (given embeddings: {"image_embeds": [views * mm_tokens, hidden], "span_ids": [L]})
        -> one [L, hidden] tensor each. Every view of the step goes through the tower at once,
        as transformers batches a prompt's images (SigLIP attends within a view only)."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        encoded = [item for item in items if "image_embeds" not in item]
        features = None
        if encoded:
            pixels = torch.cat([item["pixel_values"] for item in encoded]).to(dtype)
            states = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
            features = self.multi_modal_projector(states)  # [views, mm_tokens_per_image, hidden]
        out, start = [], 0
        for item in items:
            if "image_embeds" in item:  # given by the user: [views * mm_tokens, hidden]
                rows = item["image_embeds"]
            else:
                views = item["pixel_values"].shape[0]
                rows = features[start:start + views].flatten(0, 1)  # [views * mm_tokens, hidden]
                start += views
            out.append(span_embeddings(self.language_model.embed_tokens, item["span_ids"],
                                       self.config.image_token_id, rows))
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [num_rows, vocab]
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
