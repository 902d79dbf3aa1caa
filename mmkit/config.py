"""Engine configuration: user-facing `EngineArgs` -> one frozen `EngineConfig`.

The HF config is read once here (through `transformers.AutoConfig`) and translated into
mmkit's own names, so every component receives the same immutable object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from mmkit.models.interfaces import ModelCapabilities

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_DEVICES = ("auto", "cpu", "cuda")


def default_model_path() -> Path:
    """The embedded default checkpoint, shipped as package data (`mmkit/default_model/`).

    Found through `importlib.resources`, so editable installs, `pip install .` and wheels
    all resolve it (wheels and source installs unpack package data as real files)."""
    from importlib.resources import files

    return Path(str(files("mmkit") / "default_model"))


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the checkpoint, in mmkit's names."""

    path: str
    architecture: str
    hf_config: Any  # transformers.PretrainedConfig of the checkpoint
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    image_token_id: int | None
    # What the family declares for this checkpoint (`get_capabilities(hf_config)` of its model
    # class, models/interfaces.py): sliding layers, a fixed image token count, bidirectional
    # spans, 3-D positions, DeepStack columns, a hybrid decoder's state. Generic code reads these
    # here, never from the model object or the family's HF config fields.
    capabilities: ModelCapabilities
    # Quantized weights (models/quantization.py): a compressed-tensors checkpoint's config or
    # the online method asked for; None = the checkpoint's floats in `dtype`.
    quantization: Any = None
    # Which implementation runs it: "mmkit" (a registered family) or "transformers" (the
    # backend: transformers' own modules on mmkit's paged KV cache), chosen from `model_impl`.
    model_impl: str = "mmkit"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_kv_blocks: int | None  # exact override; None = derive from memory
    kv_cache_memory: int | None  # bytes
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    encoder_cache_memory: int  # bytes of vision embeddings kept across calls (0 = off)
    # CPU: commit every KV page at start-up (vLLM CPU's way) instead of on a block's first write.
    kv_cache_preallocate: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Placeholder tokens of items encoded per step (vLLM's encoder compute budget); 0 = the
    # token budget. One item larger than this is still encoded alone.
    max_num_encoder_input_tokens: int = 0
    max_loras: int = 0  # distinct LoRA adapters in one step (0: LoRA off)
    lora_tower: bool = False  # adapters change image embeddings: encoder-cache keys name the adapter


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int
    limit_mm_per_prompt: Mapping[str, int]
    tokenizer_path: str
    mm_processor_kwargs: Mapping[str, Any] = field(default_factory=dict)  # engine-wide processor options
    # Images of waiting requests preprocessed on worker threads, at most this many ahead
    # (mmkit/multimodal/prefetcher.py); 0 = on the engine thread at scheduling time.
    preprocess_lookahead: int = 0
    # >0: that many processes run the items' processor work (mmkit/multimodal/processor_pool.py).
    mm_processor_workers: int = 0
    # CUDA: run every decode step eagerly instead of replaying captured CUDA graphs (vLLM's name).
    enforce_eager: bool = False
    # Which kernels read the paged cache (mmkit/layers/attention_backend.py): "auto" = "flex" on
    # CUDA, "torch" (the CPU kernels) elsewhere.
    attention_backend: str = "auto"
    lora: Any = None  # mmkit.lora.LoRAConfig when enable_lora, else None


@dataclass
class EngineArgs:
    """Every argument `LLM(...)`, `LLMEngine` and `AsyncLLMEngine` accept.

    `LLM(**kwargs)` is `EngineArgs(**kwargs)` underneath.
    """

    model: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=lambda: {"image": 8})
    enable_prefix_caching: bool = True
    encoder_cache_memory: int = 256 << 20
    # CPU: make the whole KV cache resident at start-up. Off, a page is committed on the first
    # write to a block in it: a small job holds only what it uses, but every fresh block then
    # costs page faults inside the step that writes it (mmkit/worker/kv_cache.py).
    kv_cache_preallocate: bool = False
    tokenizer: str | None = None
    # Processor options for every request (e.g. {"min_pixels": ..., "max_pixels": ...}), checked
    # by the family's processor; a request's own `mm_processor_kwargs` override them key by key.
    mm_processor_kwargs: Mapping[str, Any] | None = None
    # Overlapped preprocessing: the HF image processor runs on a small thread pool for up to
    # `preprocess_lookahead` images of queued requests ahead of scheduling.
    async_preprocess: bool = True
    preprocess_lookahead: int = 16
    # Where that processor work runs: 0 = two threads of the engine's process (they share its
    # GIL); N = N worker processes (no vLLM equivalent: vLLM preprocesses in its API server
    # processes). docs/engine_args.md says how to size it.
    mm_processor_workers: int = 0
    # Online weight-only quantization of the decoder's linear layers: "int8" or "int4" (None:
    # none; a compressed-tensors checkpoint is detected from its config without this).
    quantization: str | None = None
    quantization_config: Mapping[str, Any] | None = None  # {"group_size": 32} for int4
    # vLLM's name: "auto" (the native family when registered, else the transformers backend when
    # the architecture qualifies), "mmkit" (native only) or "transformers" (the backend).
    model_impl: str = "auto"
    # Media fetching for `LLM.chat` (vLLM's names; mmkit/multimodal/media_fetch.py, docs/serving.md
    # "Media fetching"). None: LLM.chat reads any local path / fetches from any host (as before);
    # set, only files under the folder / only these hosts. The limits' None is the environment's
    # default (MMKIT_IMAGE_FETCH_TIMEOUT, MMKIT_MAX_IMAGE_FETCH_BYTES, MMKIT_MAX_IMAGE_PIXELS).
    allowed_local_media_path: str | os.PathLike | None = None
    allowed_media_domains: Sequence[str] | None = None
    image_fetch_timeout: float | None = None  # seconds for a WHOLE download
    max_image_fetch_bytes: int | None = None
    max_image_pixels: int | None = None  # width x height, from the header before decoding
    # CUDA: no CUDA graphs (every decode step eager), as vLLM's `enforce_eager`; no effect on CPU.
    enforce_eager: bool = False
    # "auto" | "torch" | "flex" | "flashinfer" | "flash_attn" (docs/gpu.md).
    attention_backend: str = "auto"
    # LoRA adapters per request (vLLM's names; mmkit/lora/): `lora_request=` on generate/chat.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enable_tower_connector_lora: bool = False

    def create_engine_config(self) -> EngineConfig:
        from mmkit.plugins import load_plugins

        self._validate()
        load_plugins()  # out-of-tree families register before the architecture is resolved
        model_path = resolve_model_path(self.model)
        model = _build_model_config(model_path, self)
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = max(2048, min(model.max_model_len, 8192))
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            encoder_cache_memory=self.encoder_cache_memory,
            kv_cache_preallocate=self.kv_cache_preallocate,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=model.max_model_len,
            max_loras=self.max_loras if self.enable_lora else 0,
            lora_tower=bool(self.enable_lora and self.enable_tower_connector_lora),
        )
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            seed=self.seed,
            limit_mm_per_prompt=dict(self.limit_mm_per_prompt),
            tokenizer_path=str(self.tokenizer or model_path),
            mm_processor_kwargs=dict(self.mm_processor_kwargs or {}),
            preprocess_lookahead=self.preprocess_lookahead if self.async_preprocess else 0,
            mm_processor_workers=self.mm_processor_workers,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            lora=self._lora_config(),
        )

    def _lora_config(self):
        from mmkit.lora.request import LoRAConfig

        if not isinstance(self.enable_lora, bool):
            raise TypeError(f"enable_lora: got {type(self.enable_lora).__name__}; expected bool")
        if not self.enable_lora:
            return None
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            _check_positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras: got {self.max_cpu_loras}; expected at least max_loras = "
                                 f"{self.max_loras}")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras,
                          bool(self.enable_tower_connector_lora))

    def _validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype: got {self.dtype!r}; expected 'auto' or one of {sorted(_DTYPES)}"
            )
        if self.device not in _DEVICES:
            raise ValueError(f"device: got {self.device!r}; expected one of {list(_DEVICES)}")
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("block_size", self.block_size)
        _check_positive("preprocess_lookahead", self.preprocess_lookahead)
        _check_mm_processor_workers(self.mm_processor_workers, self.async_preprocess)
        from mmkit.layers.attention_backend import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: got {self.attention_backend!r}; expected one of {list(BACKENDS)}")
        for name in ("async_preprocess", "kv_cache_preallocate", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: got {type(getattr(self, name)).__name__}; expected bool")
        if isinstance(self.encoder_cache_memory, bool) or not isinstance(self.encoder_cache_memory, int) \
                or self.encoder_cache_memory < 0:
            raise ValueError(f"encoder_cache_memory: got {self.encoder_cache_memory!r}; expected bytes >= 0")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: got {self.gpu_memory_utilization}; expected a value in (0, 1]"
            )
        if not isinstance(self.limit_mm_per_prompt, Mapping) or any(
            not isinstance(v, int) or v < 0 for v in self.limit_mm_per_prompt.values()
        ):
            raise ValueError(
                f"limit_mm_per_prompt: got {self.limit_mm_per_prompt!r}; expected a dict like {{'image': 4}}"
            )
        unknown = [k for k in self.limit_mm_per_prompt if k not in ("image", "video")]
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modality key(s) {unknown}; expected 'image' and/or "
                             "'video', e.g. {'image': 4, 'video': 1}")
        if self.model_impl not in ("auto", "mmkit", "transformers"):
            raise ValueError(f"model_impl: got {self.model_impl!r}; expected one of ['auto', 'mmkit', 'transformers']")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, Mapping):
            raise TypeError(f"mm_processor_kwargs: got {type(self.mm_processor_kwargs).__name__}; expected a dict "
                            "like {'max_pixels': 200704}")


def _check_mm_processor_workers(value: Any, async_preprocess: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"mm_processor_workers: got {value!r}; expected an integer >= 0 "
                         "(0: the engine's worker threads, N: N worker processes)")
    if value > 0 and async_preprocess is False:
        raise ValueError(f"mm_processor_workers: got {value} with async_preprocess=False; the worker "
                         "processes prepare images ahead of scheduling: leave async_preprocess on or pass 0")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: got {value!r}; expected a positive integer")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local folder, or a model id already in the local HF cache (never downloads)."""
    if model is None:
        path = default_model_path()
        if not (path / "config.json").exists():
            raise ValueError(
                f"model: None selects the embedded default model, but {path} holds no checkpoint"
            )
        return path
    path = Path(os.fspath(model)).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model: {str(path)!r} is a folder without config.json")
        return path
    if path.exists():
        raise ValueError(f"model: {str(path)!r} is a file; expected a checkpoint folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any hub failure means "not available offline"
        raise ValueError(
            f"model: {str(model)!r} is neither a local checkpoint folder nor a model id in the "
            f"local HuggingFace cache (mmkit never downloads weights)"
        ) from exc


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: got 'cuda' but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        # NOTE: float32 on CPU keeps outputs identical to transformers' default.
        return torch.float32
    text_config = hf_config.get_text_config()
    saved = getattr(text_config, "dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    if saved in (torch.float16, torch.bfloat16):
        return saved
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _build_model_config(path: Path, args: EngineArgs) -> ModelConfig:
    from mmkit.models.registry import ModelRegistry

    from transformers import AutoConfig

    from mmkit.models.quantization import QuantizationSpec

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    architecture, model_impl = ModelRegistry.select(hf_config, args.model_impl)
    # What the family declares (mmkit.models.interfaces.ModelCapabilities), read once here;
    # generic code never looks at the family's own config fields.
    model_cls = ModelRegistry.resolve(architecture, model_impl)[0]
    capabilities = _capabilities(model_cls, hf_config)
    # Checked here, before any weight is read: an unsupported method fails with its name.
    quantization = QuantizationSpec.from_config(hf_config, args.quantization, args.quantization_config)
    text = hf_config.get_text_config()
    device = resolve_device(args.device)
    derived_len = int(getattr(text, "max_position_embeddings", 2048) or 2048)
    max_model_len = args.max_model_len or derived_len
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    image_token_id = getattr(hf_config, "image_token_index", None)
    if image_token_id is None:
        image_token_id = getattr(hf_config, "image_token_id", None)
    return ModelConfig(
        path=str(path),
        architecture=architecture,
        hf_config=hf_config,
        dtype=resolve_dtype(args.dtype, hf_config, device),
        device=device,
        max_model_len=max_model_len,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        image_token_id=image_token_id,
        capabilities=capabilities,
        quantization=quantization,
        model_impl=model_impl,
    )


def _capabilities(model_cls: type, hf_config: Any) -> ModelCapabilities:
    """The family's one declaration, checked against the config it describes."""
    from mmkit.models.interfaces import ModelCapabilities

    declare = getattr(model_cls, "get_capabilities", None)
    if declare is None:
        raise TypeError(f"model: {model_cls.__name__} declares no get_capabilities(hf_config) classmethod; "
                        "a model class implements mmkit.models.interfaces.SupportsMultiModal (subclass "
                        "DecoderLMMixin for the default declaration)")
    capabilities = declare(hf_config)
    if not isinstance(capabilities, ModelCapabilities):
        raise TypeError(f"model: {model_cls.__name__}.get_capabilities returned {type(capabilities).__name__}; "
                        "expected mmkit.models.interfaces.ModelCapabilities")
    num_layers = hf_config.get_text_config().num_hidden_layers
    if len(capabilities.layer_sliding_windows) != num_layers:
        raise ValueError(f"model: {model_cls.__name__}.get_capabilities declares "
                         f"{len(capabilities.layer_sliding_windows)} layer sliding windows; expected one per "
                         f"decoder layer ({num_layers})")
    return capabilities
