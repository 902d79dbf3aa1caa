"""`TransformersBackendModel`: a checkpoint's own transformers class run on mmkit's engine.

The class named by the checkpoint's `architectures[0]` is loaded with transformers' own
`from_pretrained` (built on the meta device, each weight created once from the checkpoint, with
transformers' key conversions for older layouts); nothing is built when the loader constructs
this wrapper. Its language model's attention implementation is then switched to "mmkit_paged"
(models/transformers_backend/attention.py), so every decoder layer reads and writes mmkit's
paged KV cache; the vision tower keeps "sdpa".

The runner's interface (models/interfaces.py) maps onto the model's own methods:
- `embed_multimodal`: `get_image_features` per item, its rows scattered into the item's
  placeholder span at the image-token positions the processor wrote; the span's other tokens
  keep their token embeddings, so the one merge by ranges gives what the model's forward gives;
- `embed_tokens`: `get_input_embeddings()` (scaled embeddings included);
- `forward`: the language model on `inputs_embeds [1, T, hidden]` with explicit `position_ids`
  (`[1, T]`, or `[3, 1, T]` when the model computes 3-D rotary positions with `get_rope_index`);
- `compute_logits`: `get_output_embeddings()` and the final soft-capping the config declares.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from mmkit.layers.sliding_window import layer_windows
from mmkit.models.interfaces import ModelCapabilities, MultiModalKwargs
from mmkit.models.transformers_backend import attention
from mmkit.models.transformers_backend.qualify import transformers_class
from mmkit.models.transformers_backend.quirks import quirks_of
from torch import nn

from mmkit import envs

# Keys of an item's model inputs that belong to mmkit (the span), not to get_image_features.
SPAN_IDS_KEY = "mmkit_span_ids"
FEATURE_MASK_KEY = "mmkit_feature_mask"


def language_model_of(hf_model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm) of a composite model."""
    inner = getattr(hf_model, "model", hf_model)
    for name in ("language_model", "text_model"):
        lm = getattr(inner, name, None)
        if isinstance(lm, nn.Module):
            # Llama 4 holds a whole causal LM there (its head on top): the decoder is inside.
            return lm.model if isinstance(getattr(lm, "model", None), nn.Module) and hasattr(lm, "lm_head") else lm
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    if isinstance(decoder, nn.Module):
        return decoder
    raise ValueError(f"model: cannot find the language model of {type(hf_model).__name__} "
                     "(no model.language_model / get_decoder())")


def rope_index_owner(hf_model: nn.Module) -> Any:
    """The module whose `get_rope_index` computes the model's 3-D positions, or None."""
    for module in (getattr(hf_model, "model", None), hf_model):
        if module is not None and callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def has_rope_index(cls: type) -> bool:
    """Whether a transformers class (or its inner model class) computes 3-D positions with
    `get_rope_index`: decided from the class, before anything is built."""
    if callable(getattr(cls, "get_rope_index", None)):
        return True
    import importlib

    module = importlib.import_module(cls.__module__)
    inner = getattr(module, cls.__name__.replace("ForConditionalGeneration", "Model"), None)
    return inner is not None and callable(getattr(inner, "get_rope_index", None))


def features_as_rows(features: Any, hidden_size: int) -> torch.Tensor:
    """What `get_image_features` returns (a tensor, a list / tuple of per-image tensors, or a
    model output whose `pooler_output` holds them) -> [rows, hidden]."""
    if hasattr(features, "pooler_output") and getattr(features, "pooler_output", None) is not None:
        features = features.pooler_output
    elif hasattr(features, "image_embeds") and getattr(features, "image_embeds", None) is not None:
        features = features.image_embeds
    elif hasattr(features, "last_hidden_state") and not isinstance(features, torch.Tensor):
        features = features.last_hidden_state
    if isinstance(features, (list, tuple)):
        return torch.cat([features_as_rows(f, hidden_size) for f in features])
    return features.reshape(-1, hidden_size)


class TransformersBackendModel(nn.Module):
    """Any qualifying transformers image-text-to-text class on mmkit's paged KV cache
    (`SupportsMultiModal`; its capabilities read from the checkpoint's config and class)."""

    supports_multimodal: ClassVar[bool] = True
    model_impl: ClassVar[str] = "transformers"

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        """The config's sliding layers; 3-D positions when the class has `get_rope_index`;
        bidirectional spans where the forward's mask opens them (quirks.py). Spans come from what
        the processor writes, per item: no fixed image token count."""
        hf_class = transformers_class((getattr(hf_config, "architectures", None) or [None])[0])
        return ModelCapabilities(layer_sliding_windows=tuple(layer_windows(hf_config.get_text_config())),
                                 uses_mrope=hf_class is not None and has_rope_index(hf_class),
                                 bidirectional_spans=quirks_of(hf_config).bidirectional is not None)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Nothing here: `qualify.py` decides which configs the backend takes."""

    def __init__(self, config: Any, max_positions: int = 0) -> None:
        super().__init__()
        self.config = config
        self.architecture = (getattr(config, "architectures", None) or [None])[0]
        self.hf_class = transformers_class(self.architecture)
        self.hf_model: nn.Module | None = None  # built by load_checkpoint (weights read once)
        text = config.get_text_config()
        self.hidden_size = text.hidden_size
        # Layers of "chunked_attention" in layer_types attend within attention_chunk_size chunks.
        chunk = getattr(text, "attention_chunk_size", None)
        self.layer_chunk_sizes = tuple(chunk if t == "chunked_attention" else None
                                       for t in (getattr(text, "layer_types", None) or []))
        self.layer_windows = self.get_capabilities(config).layer_sliding_windows
        self.final_logit_softcapping = (getattr(config, "final_logit_softcapping", None)
                                        or getattr(text, "final_logit_softcapping", None))
        self.position_offset = quirks_of(config).position_offset
        self.logit_scale = getattr(text, "logit_scale", None) if quirks_of(config).scale_logits else None

    # ------------------------------------------------------------------ loading
    def load_checkpoint(self, path: Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> None:
        """transformers' own loading (meta init, weights created once in `dtype` on `device`)."""
        if getattr(self, "quantization", None) is not None:
            raise ValueError(f"quantization: not supported with model_impl='transformers' "
                             f"({self.architecture}); use model_impl='mmkit' where the family is native")
        attention.register()
        load = dict(config=self.config, dtype=dtype or torch.float32, device_map=str(device or "cpu"),
                    local_files_only=True)
        try:
            try:
                hf_model = self.hf_class.from_pretrained(str(path), attn_implementation="sdpa", **load)
            except ValueError as err:  # a sub-model without SDPA (Gemma 2 in PaliGemma 2): eager there
                if "scaled_dot_product_attention" not in str(err):
                    raise
                hf_model = self.hf_class.from_pretrained(str(path), attn_implementation="eager", **load)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            # transformers itself cannot build this class from this config (a config written
            # for another architecture, fields missing): say so, with what mmkit runs natively.
            from mmkit.models.registry import ModelRegistry

            raise ValueError(
                f"model: transformers' {self.hf_class.__name__} could not be built from {path}/config.json "
                f"({type(exc).__name__}: {exc}); model_impl='transformers' runs what transformers itself "
                f"loads. mmkit's native families: {', '.join(ModelRegistry.get_supported_archs())}") from exc
        self.hf_model = hf_model.eval()
        self.language_model = language_model_of(hf_model)
        self.language_model.config._attn_implementation = attention.ATTN_IMPLEMENTATION
        # Float32 buffers (rotary inverse frequencies) stay float32 across the loader's final
        # cast, as transformers keeps them in a bf16 model; complex ones (Llama 4's vision
        # rotary `freqs_ci`) keep their imaginary part.
        self._fp32_buffers = [(m, n, b.detach().clone()) for m in hf_model.modules()
                              for n, b in m.named_buffers(recurse=False)
                              if b.dtype == torch.float32 or b.is_complex()]
        # DeepSeek-VL has get_image_features on its base model only.
        owner = (hf_model if callable(getattr(hf_model, "get_image_features", None))
                 else getattr(hf_model, "model", None))
        self._get_image_features = getattr(owner, "get_image_features", None)
        self._image_feature_params = _parameter_names(self._get_image_features)

    def prepare_for_inference(self) -> int:
        for module, name, fp32 in self._fp32_buffers:
            if getattr(module, name).dtype != fp32.dtype:
                setattr(module, name, fp32.to(getattr(module, name).device))
        self._fp32_buffers = []
        if not envs.MMKIT_BACKEND_PACKED_LINEAR:  # A/B: transformers' own linears
            return 0
        from mmkit.models.transformers_backend.linear import swap_linears

        # The decoder's linears drop their row-major copy once packed; the LM head keeps it
        # (it may be the token embedding, tied).
        head = self.hf_model.get_output_embeddings()
        return swap_linears(self.language_model, release_weights=True) + \
            (swap_linears(head, release_weights=False) if isinstance(head, nn.Module) else 0)

    # ------------------------------------------------------------------ multimodal interface
    @classmethod
    def get_num_placeholder_tokens(cls, hf_config: Any, image_size: tuple[int, int],
                                   image_processor: Any = None) -> int:
        raise NotImplementedError("the transformers backend reads spans from the processor's output")

    @torch.inference_mode()
    def embed_multimodal(self, items: Sequence[MultiModalKwargs]) -> list[torch.Tensor]:
        """One [span_len, hidden] per item: the model's own features at the feature positions
        of the item's span, token embeddings elsewhere."""
        out = []
        for item in items:
            span_ids = item[SPAN_IDS_KEY]
            mask = item[FEATURE_MASK_KEY].bool()
            if self._get_image_features is None:
                raise ValueError(f"model: {self.architecture} has no get_image_features (on the model or its base "
                                 "model); the transformers backend cannot encode its images")
            raw = self._get_image_features(**self._feature_kwargs(item))
            features = features_as_rows(raw, self.hidden_size)
            if features.shape[0] != int(mask.sum()):
                raise ValueError(f"model: {self.architecture}'s get_image_features returned {features.shape[0]} rows "
                                 f"for an image whose span holds {int(mask.sum())} image tokens; refusing to "
                                 "misalign them")
            if bool(mask.all()):
                out.append(features.clone())
                continue
            rows = self.embed_tokens(span_ids).clone()
            rows[mask] = features.to(rows.dtype)
            # Ovis2: the span's marker tokens take rows of the visual table, as its forward does.
            indicators = getattr(raw, "visual_indicator_features", None)
            for i, token_id in enumerate(getattr(self.config, "visual_indicator_token_ids", None) or ()):
                if indicators is not None:
                    rows[span_ids == token_id] = indicators[i].to(rows.dtype)
            out.append(rows)
        return out

    def _feature_kwargs(self, item: MultiModalKwargs) -> dict[str, Any]:
        dtype = next(self.hf_model.parameters()).dtype
        kwargs = {}
        for key, value in item.items():
            if key in (SPAN_IDS_KEY, FEATURE_MASK_KEY):
                continue
            if self._image_feature_params is not None and key not in self._image_feature_params:
                continue
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.to(dtype)
            kwargs[key] = value
        return kwargs

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_input_embeddings()(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        # inputs_embeds [T, hidden]; positions [T] or [3, T] -> hidden [T, hidden]
        position_ids = positions[:, None, :] if positions.dim() == 2 else positions[None, :]
        if self.position_offset:
            position_ids = position_ids + self.position_offset
        flat_positions = positions[0] if positions.dim() == 2 else positions
        step = attention.BackendStep(kv_caches, meta, self.layer_chunk_sizes, flat_positions + self.position_offset,
                                     self.layer_windows)
        token = attention.current_step().set(step)
        try:
            out = self.language_model(inputs_embeds=inputs_embeds[None], position_ids=position_ids,
                                      attention_mask=None, use_cache=False, return_dict=True)
        finally:
            attention.current_step().reset(token)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _parameter_names(fn: Any) -> set[str] | None:
    """Named parameters of `fn` (None: unknown, pass every input)."""
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
