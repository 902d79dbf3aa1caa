"""Build the default model's tokenizer (trained offline with `tokenizers`) and its LlavaProcessor.

    python training/build_processor.py --out training/state/processor

The tokenizer is a byte-level BPE trained on the scene template text (so any text still encodes),
with the special tokens <unk>=0, <s>=1, </s>=2, <pad>=3, <image>=4. A post-processor prepends <s>.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mmkit"))
import scenes  # noqa: E402  (pure python; imported by path so mmkit/__init__ is not needed)

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
IMAGE_SIZE = 128
PATCH_SIZE = 16

# LLaVA-1.5 style: "USER: <image>\nWhat color is the circle? ASSISTANT:" (images first, then
# text); assistant turns end with </s>. Content may be a string or a list of typed parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}{% endif %}"
    "{% else %}"
    "{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ ' ' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def prompt_text(question: str) -> str:
    """The exact training prompt (what the chat template renders with add_generation_prompt)."""
    return f"USER: <image>\n{question} ASSISTANT:"


def corpus():
    words = set()
    lines = []
    for seed in range(3000):
        s = scenes.make_scene(seed)
        for q, a, _ in s.qa:
            lines.append(prompt_text(q) + " " + a)
    lines += ["USER: ASSISTANT: SYSTEM: user assistant system", "Caption it. What is in the image?"]
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image>"},
                                   padding_side="left", chat_template=CHAT_TEMPLATE)
    return fast


def build_processor():
    from transformers import CLIPImageProcessor, LlavaProcessor
    tokenizer = build_tokenizer()
    ip = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=ip, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                          num_additional_image_tokens=1, vision_feature_select_strategy="default",
                          chat_template=CHAT_TEMPLATE, image_token="<image>")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="training/state/processor")
    a = ap.parse_args()
    p = build_processor()
    p.save_pretrained(a.out)
    print("vocab", len(p.tokenizer), "saved to", a.out)


if __name__ == "__main__":
    main()
