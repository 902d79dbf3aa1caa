"""Shared pieces of the default-model training and evaluation: config, fast preprocessing, batches."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: default spinning collapses 2-core boxes

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "mmkit"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenes  # noqa: E402
from build_processor import IMAGE_SIZE, PATCH_SIZE, build_processor, prompt_text  # noqa: E402,F401

GRID = IMAGE_SIZE // PATCH_SIZE            # 8 x 8 patches
IMAGE_SEQ_LEN = GRID * GRID                 # 64 image tokens ("default" strategy drops CLS)
CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


def make_config(vocab_size: int, image_token_id: int, vision_layers=4, vision_hidden=128,
                text_layers=4, text_hidden=256):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    vc = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=4 * vision_hidden,
                          num_hidden_layers=vision_layers, num_attention_heads=vision_hidden // 32,
                          image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=vision_hidden,
                          hidden_act="quick_gelu")
    tc = LlamaConfig(vocab_size=vocab_size, hidden_size=text_hidden,
                     intermediate_size=int(text_hidden * 2.75), num_hidden_layers=text_layers,
                     num_attention_heads=text_hidden // 64, num_key_value_heads=text_hidden // 64,
                     max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                     pad_token_id=3, tie_word_embeddings=False, hidden_act="silu")
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_token_id,
                      projector_hidden_act="gelu", vision_feature_select_strategy="default",
                      vision_feature_layer=-1, image_seq_length=IMAGE_SEQ_LEN, tie_word_embeddings=False)
    cfg.pad_token_id = 3
    return cfg


def square_uint8(img: Image.Image) -> torch.Tensor:
    """Resize + centre-crop exactly like the (torchvision) CLIPImageProcessor -> CHW uint8."""
    from torchvision.transforms.v2 import functional as tvF
    t = tvF.pil_to_tensor(img.convert("RGB"))
    h, w = t.shape[-2:]
    if (h, w) != (IMAGE_SIZE, IMAGE_SIZE):
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(IMAGE_SIZE * long / short)
        size = (new_long, IMAGE_SIZE) if w <= h else (IMAGE_SIZE, new_long)
        t = tvF.resize(t, list(size), interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    h, w = t.shape[-2:]
    top, left = int(round((h - IMAGE_SIZE) / 2.0)), int(round((w - IMAGE_SIZE) / 2.0))
    return t[:, top:top + IMAGE_SIZE, left:left + IMAGE_SIZE].contiguous()


def normalize(u8: torch.Tensor) -> torch.Tensor:
    """[N,3,H,W] uint8 -> CLIP-normalised float32 pixel_values (fused like the HF processor)."""
    from torchvision.transforms.v2 import functional as tvF
    mean = (CLIP_MEAN.view(3) * (1.0 / (1 / 255))).tolist()  # as the processor fuses rescale+normalize
    std = (CLIP_STD.view(3) * (1.0 / (1 / 255))).tolist()
    return tvF.normalize(u8.to(torch.float32), mean, std)


def patch_labels(scene) -> np.ndarray:
    """[GRID*GRID, 4] int: per patch (shape, colour, size, rank) class; 0 = background."""
    sub = 4
    m = np.asarray(scenes.label_mask(scene, GRID * sub), dtype=np.int64)
    m = m.reshape(GRID, sub, GRID, sub).transpose(0, 2, 1, 3).reshape(GRID * GRID, sub * sub)
    out = np.zeros((GRID * GRID, 4), dtype=np.int64)
    for p in range(GRID * GRID):
        counts = np.bincount(m[p], minlength=4)
        counts[0] = 0
        k = int(counts.argmax())
        if counts[k] >= 3:  # covers >= 3/16 of the patch
            s = scene.shapes[k - 1]
            out[p] = (scenes.SHAPES.index(s.shape) + 1, scenes.COLORS.index(s.color) + 1,
                      scenes.SIZES.index(s.size) + 1, k)
    return out


class TextCache:
    """Token ids of prompts/answers (the tokenizer is tiny; strings repeat a lot)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.image_id = tokenizer.convert_tokens_to_ids("<image>")
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id
        self._p, self._a = {}, {}

    def prompt(self, question: str):
        ids = self._p.get(question)
        if ids is None:
            raw = self.tok(prompt_text(question))["input_ids"]
            ids = []
            for t in raw:
                ids.extend([self.image_id] * IMAGE_SEQ_LEN if t == self.image_id else [t])
            self._p[question] = ids
        return ids

    def answer(self, answer: str):
        ids = self._a.get(answer)
        if ids is None:
            ids = self.tok(" " + answer, add_special_tokens=False)["input_ids"] + [self.eos]
            self._a[answer] = ids
        return ids


def lm_batch(cache: TextCache, items):
    """items: list of (question, answer) -> input_ids, attention_mask, labels (right padded)."""
    seqs, labs = [], []
    for q, a in items:
        p, r = cache.prompt(q), cache.answer(a)
        seqs.append(p + r)
        labs.append([-100] * len(p) + r)
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), cache.pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, :len(l)] = torch.tensor(l)
    return ids, mask, labels


