"""mmkit's Qwen2 decoder on the paged KV cache (the language model of Qwen2-VL / Qwen2.5-VL).

Qwen2 is the Llama block with biases on the q/k/v projections (none on o_proj), which
`models/llama.py` builds for every Qwen2 text model type (`QKV_BIAS_MODEL_TYPES`; the same code
serves LLaVA-OneVision's and LLaVA-interleave's Qwen2 decoders). In the VL models the rotary
positions are M-RoPE: the step's positions arrive as [3, num_tokens] and `RotaryEmbedding`
reads each frequency's angle from its section's row.
"""

from __future__ import annotations

from mmkit.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    """The Qwen2 decoder stack without the LM head (HF's `Qwen2VLTextModel` / `Qwen2Model`)."""

    # use_sliding_window: the config's layer_types name the sliding layers (LlamaModel reads them).
