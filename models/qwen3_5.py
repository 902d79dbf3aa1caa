"""Qwen3.5 (dense and MoE): a hybrid decoder, three Gated DeltaNet layers to one full-attention
layer (`layer_types`), behind the Qwen3-VL tower without DeepStack.

- Linear-attention layers (`linear_attn`): one projection to q|k|v, a short causal convolution
  over it (kernel `linear_conv_kernel_dim`, SiLU), the gated delta rule
  (mmkit/layers/gated_delta_rule.py) with a per-head decay `g = -exp(A_log) * softplus(a +
  dt_bias)` and write strength `beta = sigmoid(b)`, then an RMSNorm gated by SiLU(z) per value
  head. They keep a per-request state (conv window + recurrent state) in the runner's state
  cache (mmkit/worker/state_cache.py), declared in its `ModelCapabilities.state_spec`; no KV cache.
- Full-attention layers (`self_attn`): q_proj gives each head its query and an output gate
  (`[q_h | gate_h]` per head), q/k RMS-normalised per head with (1 + w) weights, rotary on the
  first `partial_rotary_factor * head_dim` dims only (interleaved M-RoPE), paged attention, then
  `out * sigmoid(gate)` before o_proj.
- Every norm of the stack is Gemma's (1 + w) RMSNorm; residual adds as transformers does them.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from mmkit.layers.attention import AttentionMetadata, paged_attention
from mmkit.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from mmkit.layers.rotary import RotaryEmbedding, StepRope
from mmkit.layers.short_conv import causal_conv_chunk, causal_conv_step
from mmkit.layers.state_spec import StateSpec
from mmkit.models.gemma3 import GemmaRMSNorm
from mmkit.models.interfaces import ModelCapabilities
from mmkit.models.llama import Linear, LlamaMLP
from mmkit.models.moe import MoeExperts, SparseMoeBlock
from mmkit.models.qwen3_vl import Qwen3VLForConditionalGeneration

LINEAR_ATTENTION = "linear_attention"


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated: normalise in float32, weight (no +1) in the input
    dtype, times SiLU(gate) in float32, cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(torch.float32))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        hidden = config.hidden_size
        self.activation = config.hidden_act
        self.in_proj_qkv = Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, self.num_v_heads, bias=False)
        # checkpoint name and shape [conv_dim, 1, K] (a depthwise nn.Conv1d in transformers)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def _split(self, mixed: torch.Tensor):
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(n, self.num_k_heads, self.head_k_dim), k.reshape(n, self.num_k_heads, self.head_k_dim),
                v.reshape(n, self.num_v_heads, self.head_v_dim))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; the step's rows by state slot come in meta.state_batch (decodes first)
        batch = meta.state_batch
        num_tokens = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x)  # [T, value_dim]
        beta = self.in_proj_b(x).sigmoid()  # [T, v_heads]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, v_heads]
        windows, states = batch.cache.layer(self.layer_idx)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, K]
        core = x.new_empty(num_tokens, self.num_v_heads, self.head_v_dim)
        num_decodes = batch.num_decodes
        if num_decodes:
            slots = batch.decode_slots
            conv_out, windows[slots] = causal_conv_step(mixed[:num_decodes], windows[slots], weight, None,
                                                        self.activation)
            q, k, v = self._split(conv_out)
            core[:num_decodes], states[slots] = recurrent_gated_delta_rule(
                q, k, v, g[:num_decodes], beta[:num_decodes], states[slots])
        for start, length, slot in batch.prefills:
            rows = slice(start, start + length)
            conv_out, windows[slot] = causal_conv_chunk(mixed[rows], windows[slot], weight, None, self.activation)
            q, k, v = self._split(conv_out)
            core[rows], states[slot] = chunk_gated_delta_rule(q, k, v, g[rows], beta[rows], states[slot])
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate, (1 + w) q/k norms and partial rotary."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        rope = getattr(config, "rope_parameters", None) or {}
        self.rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.scale = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)  # query and gate
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, nh, nkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x).view(num_tokens, nh, 2 * hd).chunk(2, dim=-1)  # [T, nh, hd] each
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(num_tokens, nkv, hd))
        v = self.v_proj(x).view(num_tokens, nkv, hd)
        qk = torch.cat([q, k], dim=1)  # [T, nh + nkv, hd]
        rd = self.rotary_dim
        rotated = rope.rotate(qk[..., :rd].contiguous(), nh + nkv)
        qk = torch.cat([rotated, qk[..., rd:]], dim=-1) if rd < hd else rotated
        out = paged_attention(qk[:, :nh], qk[:, nh:], v, kv_cache[0], kv_cache[1], meta, self.scale, None)
        out = out.reshape(num_tokens, nh * hd) * torch.sigmoid(gate.reshape(num_tokens, nh * hd))
        return self.o_proj(out)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, meta) if self.is_linear else self.self_attn(h, rope, kv_cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class PerExpertWeights(MoeExperts):
    """The experts as Qwen3.5-MoE checkpoints store them, one `experts.{e}.{gate,up,down}_proj`
    per expert (transformers fuses them on load); `fuse_weights` stacks them once into
    models/moe.py's `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, whose grouped forward runs."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate_size = experts, inter
        self.act = ACT2FN[config.hidden_act]
        self._packed = None
        for e in range(experts):
            expert = nn.Module()
            expert.gate_proj = nn.Linear(hidden, inter, bias=False)
            expert.up_proj = nn.Linear(hidden, inter, bias=False)
            expert.down_proj = nn.Linear(inter, hidden, bias=False)
            self.add_module(str(e), expert)

    @torch.no_grad()
    def fuse_weights(self) -> None:
        experts = [getattr(self, str(e)) for e in range(self.num_experts)]
        self.gate_up_proj = nn.Parameter(torch.stack([torch.cat([x.gate_proj.weight, x.up_proj.weight])
                                                      for x in experts]), requires_grad=False)
        self.down_proj = nn.Parameter(torch.stack([x.down_proj.weight for x in experts]), requires_grad=False)
        for e in range(self.num_experts):
            delattr(self, str(e))


class SharedExpertMoeBlock(SparseMoeBlock):
    """transformers' Qwen3NextSparseMoeBlock: the routed experts (mmkit's grouping, models/moe.py)
    plus one shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.experts = PerExpertWeights(config)
        shared = SimpleNamespace(hidden_size=config.hidden_size, hidden_act=config.hidden_act,
                                 intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def fuse_weights(self) -> None:
        self.experts.fuse_weights()
        self.shared_expert.fuse_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        shared = self.shared_expert(x)
        routed = super().forward(x)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(config)  # every layer routes (transformers' Qwen3.5-MoE)


class Qwen3_5TextModel(nn.Module):
    """The hybrid decoder stack without the LM head (HF's `Qwen3_5TextModel`)."""

    decoder_layer_cls: type[nn.Module] = Qwen3_5DecoderLayer

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # transformers' own rotary (partial dims, its mrope_section default): the table's width
        # is the rotary dims; interleaved M-RoPE as Qwen3-VL.
        hf_rotary = Qwen3_5TextRotaryEmbedding(config)

        def text_rotary(x: torch.Tensor, position_ids: torch.Tensor):
            # The three M-RoPE rows all equal the text positions: transformers 5.17 takes only
            # [3, batch, positions] (newer releases also take [batch, positions]).
            return hf_rotary(x, position_ids.expand(3, -1, -1))

        self.rotary = RotaryEmbedding(config, max_positions, list(hf_rotary.mrope_section), mrope_interleaved=True,
                                      hf_rotary=text_rotary)

    def fuse_weights(self) -> None:
        for layer in self.layers:
            if hasattr(layer.mlp, "fuse_weights"):
                layer.mlp.fuse_weights()

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        # inputs_embeds: [T, hidden]; positions: [T] or [3, T] M-RoPE rows
        x = inputs_embeds
        rope = self.rotary.for_positions(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)


class Qwen3_5MoeTextModel(Qwen3_5TextModel):
    decoder_layer_cls = Qwen3_5MoeDecoderLayer


def qwen3_5_state_spec(text: Any) -> StateSpec:
    """Per linear-attention layer: the conv window over q|k|v and the [v_heads, k_dim, v_dim] state."""
    layer_ids = tuple(i for i, t in enumerate(text.layer_types[:text.num_hidden_layers]) if t == LINEAR_ATTENTION)
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim \
        + text.linear_num_value_heads * text.linear_value_head_dim
    return StateSpec(layer_ids, conv_dim, text.linear_conv_kernel_dim - 1,
                     (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim))


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """`SupportsMultiModal`, declaring `uses_mrope` and a hybrid decoder's `state_spec`."""

    decoder_cls: Any = Qwen3_5TextModel
    # transformers' `_keys_to_ignore_on_load_unexpected`: the multi-token-prediction head is not run
    ignored_checkpoint_prefixes = ("mtp.",)

    @classmethod
    def get_capabilities(cls, hf_config: Any) -> ModelCapabilities:
        return replace(super().get_capabilities(hf_config), state_spec=qwen3_5_state_spec(hf_config.get_text_config()))

    @classmethod
    def deepstack_layers(cls, hf_config: Any) -> int:
        return 0  # the Qwen3.5 tower has no DeepStack mergers

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        text = hf_config.get_text_config()
        kinds = set(text.layer_types[:text.num_hidden_layers]) - {LINEAR_ATTENTION, "full_attention"}
        if kinds:
            raise ValueError(f"model: {cls.__name__} with layer types {sorted(kinds)} is not supported; "
                             "expected 'linear_attention' and 'full_attention'")
        if text.linear_num_value_heads % text.linear_num_key_heads:
            raise ValueError(f"model: linear_num_value_heads {text.linear_num_value_heads} is no multiple of "
                             f"linear_num_key_heads {text.linear_num_key_heads}")

    def _build_decoder(self, text, max_positions: int):
        return self.decoder_cls(text, max_positions)

    @staticmethod
    def _vision_class():
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    def _feature_rows(self, out: Any) -> torch.Tensor:
        return out.pooler_output  # [sum tokens, hidden]: no DeepStack sets


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """Qwen3.5-MoE: the same hybrid stack with routed experts and a shared expert in every layer."""

    decoder_cls = Qwen3_5MoeTextModel

    @staticmethod
    def _vision_class():
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
