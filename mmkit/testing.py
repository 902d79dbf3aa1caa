"""Build tiny random LLaVA checkpoints offline (tokenizer trained here, processor saved beside).

Used by the tests' fixtures and by the benchmarks; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

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

_CORPUS = [
    "USER: What is in the image? ASSISTANT: A red circle on a white background.",
    "Describe the picture in detail, please. The quick brown fox jumps over the lazy dog.",
    "How many shapes are there? two. What color is the square? blue. Is there a triangle? yes.",
    "Write a haiku about the sea. Waves fold into foam; salt wind carries gull voices; the tide keeps its time.",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600 emoji and unicode text for byte level tests",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" the a an of to in is it that",
]


def build_tokenizer(out_dir: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image>"})
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llava(out_dir: str | Path, *, seed: int = 0, num_kv_heads: int = 4,
                     tie_word_embeddings: bool = False, text_layers: int = 2, hidden: int = 64,
                     num_heads: int = 4, image_size: int = 32, patch_size: int = 8,
                     max_position_embeddings: int = 512, init_std: float = 0.08,
                     intermediate: int | None = None, vocab_size: int = 384, tokenizer=None) -> Path:
    """Save a random LLaVA (CLIP tower + projector + Llama decoder) with its processor."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlamaConfig,
                              LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_tokenizer(out, vocab_size)
    else:
        tokenizer.save_pretrained(out)
    vocab = len(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                       num_hidden_layers=text_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       initializer_range=init_std)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               num_additional_image_tokens=1, vision_feature_select_strategy="default",
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def rewrite_hub_layout(src: str | Path, dst: str | Path, num_shards: int = 2) -> Path:
    """The same weights the way llava-hf repos on the hub store them: old key names,
    `rope_theta`, fp16, sharded with an index."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    renamed = {}
    for key, tensor in state.items():
        if key.startswith("model.language_model."):
            key = "language_model.model." + key[len("model.language_model."):]
        elif key.startswith("model."):
            key = key[len("model."):]
        elif key == "lm_head.weight":
            key = "language_model.lm_head.weight"
        renamed[key] = tensor.to(torch.float16).contiguous()
    keys = sorted(renamed)
    shards = [keys[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: renamed[k] for k in shard}, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters", None) or {}
    text["rope_theta"] = rope.get("rope_theta", 10000.0)
    text.pop("rope_scaling", None)
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
