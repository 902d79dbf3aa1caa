"""mmkit's Qwen2 decoder on the paged KV cache (the language model of Qwen2-VL / Qwen2.5-VL).

Qwen2 is the Llama block with biases on the q/k/v projections (none on o_proj) and, in the VL
models, M-RoPE: the step's positions arrive as [3, num_tokens] and `RotaryEmbedding` reads each
frequency's angle from its section's row. Everything else (fused qkv, paged attention, the
bf16 CPU kernels) is `models/llama.py`'s code.

NOTE: kept separate from the LLaVA-family decoders on purpose (a Qwen2 decoder for
LLaVA-OneVision may land elsewhere); both are this module's Llama subclass in substance.
"""

from __future__ import annotations

from torch import nn

from mmkit.models.llama import Linear, LlamaAttention, LlamaDecoderLayer, LlamaModel


class Qwen2Attention(LlamaAttention):
    def __init__(self, config) -> None:
        super().__init__(config)
        hidden, hd = config.hidden_size, self.head_dim
        self.q_proj = Linear(hidden, self.num_heads * hd, bias=True)
        self.k_proj = Linear(hidden, self.num_kv_heads * hd, bias=True)
        self.v_proj = Linear(hidden, self.num_kv_heads * hd, bias=True)
        self.o_proj = Linear(self.num_heads * hd, hidden, bias=False)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.self_attn = Qwen2Attention(config)


class Qwen2Model(LlamaModel):
    """The Qwen2 decoder stack without the LM head (HF's `Qwen2VLTextModel` / `Qwen2Model`)."""

    def __init__(self, config, max_positions: int) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("model: Qwen2 decoders with use_sliding_window=True are not supported")
        super().__init__(config, max_positions)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers))
