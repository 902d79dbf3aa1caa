"""mmkit's Llama-family decoder on the paged KV cache (Llama/Vicuna, Mistral, Qwen2).

Parameter names follow transformers' LlamaModel (`embed_tokens`, `layers.N.self_attn.q_proj`,
...) so checkpoints load without renaming. Tokens of a step come flattened:
hidden states are `[num_tokens, hidden_size]`, never padded.
"""

from __future__ import annotations

import functools

import torch
from mmkit.models.llama_decode_stack import DecodeStack
from mmkit.models.moe import SparseMoeBlock
from torch import nn
from transformers.activations import ACT2FN

from mmkit import envs
from mmkit.layers import cpu_kernels, fused_f32, linear_panels
from mmkit.layers.attention import AttentionMetadata, paged_attention
from mmkit.layers.norms import RMSNorm
from mmkit.layers.quantized_linear import QuantizedLinear, fuse_quantized
from mmkit.layers.rotary import RotaryEmbedding, StepRope
from mmkit.layers.sliding_window import layer_windows


def can_pack_for_onednn(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and envs.MMKIT_PACKED_LINEAR and _onednn_bf16_packs())


@functools.cache
def _onednn_bf16_packs() -> bool:
    """oneDNN packs bf16 linear weights only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT: on
    an AVX2-only CPU (AMD Zen 2/3) the reorder raises, and bf16 then runs `F.linear` (or the
    panels, which have an AVX2 path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


# float32 rows up to which `Linear` runs the C GEMV instead of a matmul (MMKIT_GEMV_MAX_ROWS=0: never).
GEMV_MAX_ROWS = envs.MMKIT_GEMV_MAX_ROWS


class Linear(nn.Linear):
    """nn.Linear that, on CPU, runs on a weight packed once after loading.

    `F.linear` in bf16 reorders the weight into a blocked layout on every call, which for the
    small batches of decoding costs more than the matmul, and MKL's float32 GEMM reads weights
    at about half the memory bandwidth at small batch. `pack()` packs the weight once: into
    mmkit's 32-row panels (`mmkit/layers/linear_panels.py`, bf16 and float32) on CPUs with
    AVX512-BF16, one copy that is fast at every batch size; elsewhere bf16 goes to oneDNN's
    layout (the same matmul as `F.linear`, bit-identical in our checks) and float32 up to
    `GEMV_MAX_ROWS` rows to `cpu_kernels.dense_gemv`. CUDA uses `F.linear` unchanged.
    MMKIT_PACKED_LINEAR=0 / MMKIT_LINEAR_PANELS=0 / MMKIT_GEMV_MAX_ROWS=0 disable each (A/B).
    On CPUs with AMX a bf16 weight keeps oneDNN's packed copy too (`_onednn`), which runs every
    call above `linear_panels.BF16_MAX_ROWS` rows: the tiles are 8-12x faster at 128+ rows.
    """

    _packed: torch.Tensor | None = None
    _run_panels = None  # linear_panels.bind(...) when `_packed` holds panels (else oneDNN's layout)
    _onednn: torch.Tensor | None = None  # oneDNN's packed copy beside the panels (AMX CPUs)
    _panel_max_rows: int | None = None  # rows above which `_onednn` runs
    # A fused gate/up projection of a SiLU MLP ([gate | up]) sets this to the intermediate size
    # (LlamaMLP.fuse_weights): `pack()` then also binds the GEMM with SiLU-mul in its epilogue.
    silu_mul_inter: int | None = None
    _run_silu_mul = None

    @property
    def _panels(self) -> bool:
        return self._run_panels is not None

    @torch.no_grad()
    def pack(self, release_weight: bool = False) -> None:
        """`release_weight`: drop the row-major weight once packed (the packed copy is the
        only one then: half the resident weight memory). Not for a weight shared with
        another module (a tied LM head)."""
        self._run_panels, self._onednn, self._panel_max_rows, self._run_silu_mul = None, None, None, None
        linear_panels.bump_generation()
        if envs.MMKIT_PACKED_LINEAR and linear_panels.can_pack(self.weight):
            self._packed = linear_panels.pack(self.weight.detach())
            self._run_panels = linear_panels.bind(self._packed, self.out_features, self.bias)
            if self.silu_mul_inter:
                self._run_silu_mul = linear_panels.bind_silu_mul(self._packed, self.silu_mul_inter, self.bias)
            if self.weight.dtype == torch.bfloat16 and linear_panels.BF16_MAX_ROWS is not None \
                    and can_pack_for_onednn(self.weight):
                # AMX: oneDNN's tiles are far faster above a few rows (linear_panels.BF16_MAX_ROWS)
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
                self._panel_max_rows = linear_panels.BF16_MAX_ROWS
        else:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1) \
                if can_pack_for_onednn(self.weight) else None
        if self._packed is not None and release_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu(gate) * up` of this fused gate/up projection in one pass over the panels
        (`silu_mul_inter`), bit-identical to `forward` then the SiLU-mul kernel; None where the
        fused kernel does not take x (then the caller runs the two passes)."""
        run = self._run_silu_mul
        if run is None or self._to_onednn(x) or not self._panel_input(x):
            return None
        return run(x)

    def _to_onednn(self, x: torch.Tensor) -> bool:
        """AMX: more rows than `_panel_max_rows` go to oneDNN's packed copy (class docstring)."""
        return (self._onednn is not None and x.dim() == 2 and x.shape[0] > self._panel_max_rows
                and x.dtype is torch.bfloat16)

    def _panel_input(self, x: torch.Tensor) -> bool:
        """x is what the bound panel kernels take as it is: 2-D CPU rows of the panels' dtype
        with dense columns."""
        return (x.dtype is self._packed.dtype and x.dim() == 2 and x.is_cpu and x.shape[1] == self.in_features
                and x.stride(1) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, run = self._packed, self._run_panels
        if run is not None:
            if self._to_onednn(x):
                return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [None], "")
            if self._panel_input(x):
                return run(x)
            if self.weight.numel() == 0:  # released: any other shape/dtype through the panels
                flat = x.reshape(-1, self.in_features).to(packed.dtype).contiguous()
                return run(flat).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        elif packed is not None:  # oneDNN's layout (bf16)
            if x.dtype == torch.bfloat16 and x.dim() == 2:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [None], "")
            if self.weight.numel() == 0:
                flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
                out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [None], "")
                return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        elif x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.is_cpu:
            # A few float32 rows (decode at small batch) without the panels: bound by reading
            # the weight, which the C GEMV streams at ~2x MKL's rate here.
            out = cpu_kernels.dense_gemv(x, self.weight, self.bias)
            if out is not None:
                return out
        return super().forward(x)


def pack_linears(module: nn.Module, release_weights: bool = False) -> int:
    """Pack every `Linear` under `module` (call after the final dtype/device cast)."""
    count = 0
    # the activations' dtype (quantized linears pack for it): the embeddings' / norms' dtype
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            count += m.pack(dtype)
        elif isinstance(m, Linear):
            m.pack(release_weights)
            count += m._packed is not None
        elif isinstance(m, SparseMoeBlock):  # its experts pack themselves (models/moe.py)
            m.pack()
            count += m.experts._packed is not None
    return count

# HF text model types whose q/k/v projections carry a bias (the Qwen2 block).
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


class LlamaAttention(nn.Module):
    def __init__(self, config, sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # this layer's window in tokens (None: global)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 (also as Qwen2-VL's text model) adds a bias to q/k/v (not to o_proj) and has
        # no `attention_bias` field.
        qkv_bias = bias or getattr(config, "model_type", None) in QKV_BIAS_MODEL_TYPES
        hidden = config.hidden_size
        # Checkpoint names; `fuse_weights` (after loading) replaces them by one `qkv_proj`.
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qkv_proj: nn.Linear | None = None

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """One [q; k; v] matmul instead of three (fewer, larger kernels on CPU and GPU)."""
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: StepRope,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(num_tokens, nh + 2 * nkv, hd)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).view(num_tokens, nh + 2 * nkv, hd)
        qk = self.rotate_qk(qkv, rope)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, nh + nkv:]
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, nh * hd))

    def rotate_qk(self, qkv: torch.Tensor, rope: StepRope) -> torch.Tensor:
        """qkv: [num_tokens, heads + 2 * kv_heads, head_dim] -> rotated [num_tokens, heads +
        kv_heads, head_dim] (q heads, then k heads). q and k are adjacent heads of `qkv`: one
        pass rotates both. A decoder that transforms q/k before the rotation overrides this."""
        return rope.rotate(qkv, self.num_heads + self.num_kv_heads)


class LlamaMLP(nn.Module):
    def __init__(self, config, hidden_act: str | None = None) -> None:
        """`hidden_act`: the activation when the config names it otherwise (default `hidden_act`)."""
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        hidden_act = hidden_act or config.hidden_act
        self.act = ACT2FN[hidden_act]
        self.is_silu = hidden_act == "silu"
        self.gate_up_proj: nn.Linear | None = None

    @torch.no_grad()
    def fuse_weights(self) -> None:
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])
        if self.is_silu and type(self.gate_up_proj) is Linear:
            self.gate_up_proj.silu_mul_inter = self.intermediate_size
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        silu_mul = getattr(self.gate_up_proj, "silu_mul", None)  # absent under a LoRA wrapper
        act = silu_mul(x) if silu_mul is not None else None
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.is_silu and gate_up.is_cpu and (gate_up.dtype is torch.bfloat16 or gate_up.dtype is torch.float32):
            # one pass instead of split, silu, then mul
            fused = (cpu_kernels.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else fused_f32.silu_mul)(gate_up)
            if fused is not None:
                return self.down_proj(fused)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _fuse_linears(linears: list[nn.Module]) -> nn.Module:
    if not all(type(m) is Linear for m in linears):  # quantized projections (mmkit/layers/quantized_linear.py)
        fused_q = fuse_quantized(linears)
        if fused_q is None:
            raise ValueError("model: q/k/v (or gate/up) projections are quantized differently; mmkit fuses them")
        return fused_q
    first = linears[0]
    fused = Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    fused.weight.copy_(torch.cat([m.weight for m in linears]))
    if first.bias is not None:
        fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused


class LlamaDecoderLayer(nn.Module):
    # A decoder built from this block swaps the parts it changes (models/qwen3.py).
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        # Mistral v0.1 slides in every layer, Qwen2 with use_sliding_window in some (layer_types).
        self.self_attn.sliding_window = layer_windows(config)[layer_idx]
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: StepRope,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds
        them (vLLM's convention: each residual add is fused into the following RMSNorm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (a mixture-of-experts decoder picks per layer)."""
        return LlamaMLP(config)


class LlamaModel(nn.Module):
    """The decoder stack without the LM head (HF's `LlamaModel`)."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config, max_positions: int, rotary: RotaryEmbedding | None = None) -> None:
        """`rotary`: a family's own table (Qwen3-VL's interleaved M-RoPE); default from `config`."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary or RotaryEmbedding(config, max_positions)

    _stack: DecodeStack | None = None
    _stack_generation = -1

    def decode_stack(self) -> DecodeStack | None:
        """The C decode stack over this model's bound panels (built again after any re-pack),
        or None where some layer is not the plain Llama block on panels."""
        if self._stack_generation != linear_panels.generation():
            self._stack = DecodeStack.build(self)
            self._stack_generation = linear_panels.generation()
        return self._stack

    def fuse_weights(self) -> None:
        """Concatenate q/k/v and gate/up weights (call once, after loading the checkpoint)."""
        for layer in self.layers:
            layer.self_attn.fuse_weights()
            layer.mlp.fuse_weights()

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        # inputs_embeds: [num_tokens, hidden]; positions: [num_tokens] (or [3, num_tokens] M-RoPE)
        # deepstack: [num_tokens, L, hidden], added to the hidden states after layer i < L
        # (DeepStack; zero rows for tokens without vision features).
        x, residual = inputs_embeds, None
        rope = self.rotary.for_positions(positions, x.dtype)  # shared by every layer
        if deepstack is None and x.is_cpu:
            stack = self.decode_stack()
            out = stack.run(x, rope, kv_caches, meta) if stack is not None else None
            if out is not None:  # the whole stack in one C call (models/llama_decode_stack.py)
                return out
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, rope, kv_cache, meta)
            if deepstack is not None and i < deepstack.shape[1]:
                # HF: h = residual + mlp_out, then h + features: the same two roundings.
                x, residual = (residual + x) + deepstack[:, i], None
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]
