"""What every tiny transformers-backend checkpoint builder shares: the tokenizer, random values
for weights transformers initialises to constants, and saving model + processor together."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkit.testing import build_tokenizer

__all__ = ["build_tokenizer", "randomize_constant_weights", "save_checkpoint"]


@torch.no_grad()
def randomize_constant_weights(model: torch.nn.Module, scale: float = 0.2, seed: int = 1234) -> None:
    """Every parameter transformers initialises to one value (norm weights of ones or zeros,
    zero biases, zero-initialised projectors or gates) gets random noise added: a test then
    sees a norm, bias or projection computed wrongly instead of one that cannot matter."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(model.named_parameters()):
        flat = param.detach().reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def save_checkpoint(out: Path, model, processor, tokenizer) -> Path:
    """Save the weights, the processor (tokenizer inside) and a generation config naming the
    tokenizer's special ids into `out`."""
    from transformers import GenerationConfig

    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def tiny_siglip_vision(image_size: int, patch_size: int, hidden: int = 32, layers: int = 2):
    """A SigLIP tower config of `layers` layers, `hidden` wide, 4 heads, without the pooling head."""
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                              num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                              vision_use_head=False)


def tiny_cohere2_text(tokenizer, *, hidden: int, num_heads: int, num_kv_heads: int, layers: int,
                      sliding_window: int, tie_word_embeddings: bool, init_std: float, logit_scale: float = 0.5):
    """A Cohere 2 decoder config (parallel attention + MLP blocks, every 4th layer global, the
    others sliding over `sliding_window` tokens with rotary, the global ones without)."""
    from transformers import Cohere2Config

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    return Cohere2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         sliding_window=sliding_window, layer_types=layer_types, logit_scale=logit_scale,
                         max_position_embeddings=1024, initializer_range=init_std,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
