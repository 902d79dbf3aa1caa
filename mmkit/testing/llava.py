"""Build tiny random LLaVA checkpoints offline (tokenizer trained here, processor saved beside).

Used by the tests' fixtures and by the benchmarks; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmkit.testing.checkpoint_io import read_checkpoint, save_sharded

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% endif %}{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %} "
    "{% else %}ASSISTANT: {% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# The parity tests' second configuration (tests/models/llava/test_llava_second_config.py): it
# differs from the default in every dimension the builder allows: decoder (Qwen3: q/k norms),
# tower (SigLIP, every row), two feature layers, 3 heads on 1 KV head (GQA ratio 3) of head_dim
# 24 (heads * head_dim != hidden), 3 layers, rope_theta, tied embeddings (both config levels),
# no BOS token; init_std 0.2 (at 0.08 the tied head repeats one token on some releases).
SECOND_CONFIGS = {"LlavaForConditionalGeneration": dict(
    text_type="qwen3", vision_type="siglip", select_strategy="full", vision_feature_layer=[-2, -1], num_heads=3,
    num_kv_heads=1, head_dim=24, text_layers=3, intermediate=100, image_size=48, rope_theta=500000.0,
    init_std=0.2, tie_word_embeddings=True, text_tie_word_embeddings=False, add_bos=False)}

_CORPUS = [
    "USER: What is in the image? ASSISTANT: A red circle on a white background.",
    "Describe the picture in detail, please. The quick brown fox jumps over the lazy dog.",
    "How many shapes are there? two. What color is the square? blue. Is there a triangle? yes.",
    "Write a haiku about the sea. Waves fold into foam; salt wind carries gull voices; the tide keeps its time.",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600 emoji and unicode text for byte level tests",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" the a an of to in is it that",
]


def build_tokenizer(out_dir: Path, vocab_size: int = 384, special_tokens: list[str] | None = None,
                    extra_special_tokens: dict[str, str] | None = None, add_bos: bool = True):
    """A byte-level BPE trained on a small corpus; `special_tokens` (default LLaVA's) come first
    and `extra_special_tokens` become the tokenizer's named attributes (e.g. `image_token`).
    `add_bos=False`: a tokenizer without a BOS token (none set, none prepended; Qwen's kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens or SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>" if add_bos else None, eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   extra_special_tokens=extra_special_tokens or {"image_token": "<image>"})
    fast.save_pretrained(out_dir)
    return fast


def tiny_text_config(text_type: str, tokenizer, **kw):
    """A tiny decoder config of `text_type` ("llama", "mistral", "qwen2" or "qwen3"), built with
    transformers' own config class."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[text_type]
    if text_type == "llama":
        kw.pop("sliding_window", None)
    return cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **kw)


def tiny_vision(vision_type: str, image_size: int, patch_size: int):
    """(vision config, image processor, extra tokens the processor counts) for "clip" or "siglip"."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, SiglipImageProcessor, SiglipVisionConfig

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size)
    if vision_type == "siglip":
        return (SiglipVisionConfig(**common),
                SiglipImageProcessor(size={"height": image_size, "width": image_size}), 0)
    return (CLIPVisionConfig(projection_dim=32, **common),
            CLIPImageProcessor(size={"shortest_edge": image_size},
                               crop_size={"height": image_size, "width": image_size}), 1)


def build_tiny_llava(out_dir: str | Path, *, seed: int = 0, num_kv_heads: int = 4,
                     tie_word_embeddings: bool = False, text_layers: int = 2, hidden: int = 64,
                     num_heads: int = 4, image_size: int = 32, patch_size: int = 8,
                     max_position_embeddings: int = 512, init_std: float = 0.08,
                     intermediate: int | None = None, vocab_size: int = 384, tokenizer=None,
                     text_type: str = "llama", vision_type: str = "clip",
                     vision_feature_layer: int | list[int] = -2, select_strategy: str = "default",
                     sliding_window: int | None = None, rope_theta: float = 10000.0,
                     head_dim: int | None = None, add_bos: bool = True) -> Path:
    """Save a random LLaVA (CLIP/SigLIP tower + projector + Llama/Mistral/Qwen2/Qwen3 decoder)
    with its processor. `head_dim` (default hidden / heads) need not be hidden / heads;
    `add_bos=False` builds a tokenizer without BOS."""
    from transformers import (GenerationConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_tokenizer(out, vocab_size, add_bos=add_bos)
    else:
        tokenizer.save_pretrained(out)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision, image_processor, num_additional = tiny_vision(vision_type, image_size, patch_size)
    text = tiny_text_config(text_type, tokenizer, hidden_size=hidden,
                            intermediate_size=intermediate or hidden * 2, num_hidden_layers=text_layers,
                            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                            max_position_embeddings=max_position_embeddings,
                            tie_word_embeddings=tie_word_embeddings, initializer_range=init_std,
                            sliding_window=sliding_window, rope_theta=rope_theta,
                            head_dim=head_dim or hidden // num_heads)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=vision_feature_layer,
                         vision_feature_select_strategy=select_strategy,
                         projector_hidden_act="gelu", tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               num_additional_image_tokens=num_additional,
                               vision_feature_select_strategy=select_strategy, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def hub_key(key: str) -> str:
    """A checkpoint key (any llava-hf layout) as transformers 4.x wrote it to the hub.

    Written independently of mmkit's loader on purpose: this is the reference layout
    (`llava-hf/llava-1.5-7b-hf`'s key names)."""
    if key.startswith("model."):  # transformers 5 in-memory names
        key = key[len("model."):]
    if key.startswith("language_model.") and not key.startswith(("language_model.model.",
                                                                 "language_model.lm_head.")):
        key = "language_model.model." + key[len("language_model."):]
    elif key.startswith("lm_head."):
        key = "language_model." + key
    elif key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key[len("vision_tower."):]
    return key


def rewrite_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2, key_fn=None,
                       dtype: torch.dtype = torch.float16, transformers_version: str = "4.45.0.dev0") -> Path:
    """The same weights the way llava-hf repos on the hub store them (saved by transformers
    4.x): `vision_tower.vision_model.*`, `language_model.model.*`, `language_model.lm_head.*`,
    `rope_theta` in the text config, fp16, sharded with an index. Another family passes its
    own hub key names (`key_fn`, default `hub_key`), dtype and writer version."""
    src, dst = Path(src), Path(dst)
    state = read_checkpoint(src, dst)
    save_sharded({(key_fn or hub_key)(key): tensor.to(dtype) for key, tensor in state.items()}, dst, num_shards)
    config = json.loads((src / "config.json").read_text())
    for text in [config["text_config"]] + ([config["vision_config"]] if "vision_config" in config else []):
        rope = text.pop("rope_parameters", None) or {}
        if "rope_theta" in rope:
            text["rope_theta"] = rope["rope_theta"]
        text.pop("rope_scaling", None)
        text.pop("dtype", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.pop("dtype", None)
    config["transformers_version"] = transformers_version
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
