"""The mixture-of-experts MLP of Qwen3-MoE / Qwen3-VL-MoE, computed as transformers computes it.

Routing (HF's `Qwen3VLMoeTextTopKRouter`): softmax over the experts in float32, top-k, the k
weights renormalised to sum to 1 and cast back. Experts (HF's `Qwen3VLMoeTextExperts`):
`down(act(gate) * up)` per expert, scaled by the token's weight. Tokens are grouped by expert
(one argsort): each expert hit by the step runs one matmul over all its rows, so a batch of
128 decode rows costs at most `num_experts` expert matmuls, not 128 * k. A token's k results
are summed in ascending expert order, the order transformers' per-expert `index_add_` sums
them, so float32 outputs match it bit for bit for the same row groups.

Weights keep transformers 5's layout, `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`;
the hub's transposed `[E, H, 2I]` / `[E, I, H]` is transposed on load (`checkpoint_tensor`),
as transformers' own `Transpose(1, 2, check_dims=True)` conversion does. In bfloat16 on CPU
each expert's two weights are pre-packed once for oneDNN (`pack`, as models/llama.py's
`Linear`): `F.linear` would reorder them on every call, which cost more than an expert's
matmul at decode sizes (bit-identical results; float32 keeps `F.linear`, transformers' call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class MoeRouter(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] ascending per row)."""
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w /= top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        top_i, order = top_i.sort(dim=-1)  # HF sums a token's experts in ascending id order
        return top_w.gather(-1, order), top_i


class MoeExperts(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate_size = experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.act = ACT2FN[config.hidden_act]
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert (gate_up, down)

    @torch.no_grad()
    def pack(self, release_weight: bool = True) -> None:
        """bf16 on CPU: each expert's weights in oneDNN's blocked layout, once (after the final
        cast). The row-major copies are dropped by default: experts are most of a MoE model's
        weights and are never shared, so keeping both would double its memory."""
        from mmkit.models.llama import can_pack_for_onednn

        if not can_pack_for_onednn(self.gate_up_proj):
            self._packed = None
            return
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self._packed = [(reorder(self.gate_up_proj[e].contiguous(), 1), reorder(self.down_proj[e].contiguous(), 1))
                        for e in range(self.num_experts)]
        if release_weight:
            empty = torch.empty(0, dtype=self.gate_up_proj.dtype)
            self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
            self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)

    def weight_nbytes(self) -> int:
        """Bytes held: the row-major weights (unless released) and the packed copies."""
        held = [self.gate_up_proj, self.down_proj] + [w for pair in self._packed or [] for w in pair]
        return sum(t.numel() * t.element_size() for t in held)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, H] -> down(act(gate) * up) [n, H] with expert e's weights."""
        if self._packed is not None and rows.dtype == torch.bfloat16:
            gate_up, down = self._packed[e]
            linear = torch.ops.mkldnn._linear_pointwise
            gate, up = linear(rows, gate_up, None, "none", [None], "").chunk(2, dim=-1)
            return linear(self.act(gate) * up, down, None, "none", [None], "")
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor for parameter `name` in mmkit's layout: the hub's transposed
        [E, H, 2I] / [E, I, H] is transposed; a tensor already of the parameter's shape is kept
        (as transformers decides it)."""
        shape = tuple(getattr(self, name).shape)
        if tensor.dim() == 3 and tuple(tensor.shape) != shape and tuple(tensor.transpose(1, 2).shape) == shape:
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, experts [T, k] -> [T, H]."""
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)  # pair p = (token p // k, its choice p % k)
        perm = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[perm // k]  # [T * k, H], grouped
        scale = weights.reshape(-1)[perm, None]  # [T * k, 1], each pair's routing weight
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):  # one matmul pair per expert hit, never per token
            if n:
                # scaled per expert as HF does (one pass less over the [T * k, H] rows)
                torch.mul(self._expert(e, rows[start:start + n]), scale[start:start + n], out=out[start:start + n])
                start += n
        pairs = torch.empty_like(out)
        pairs[perm] = out
        pairs = pairs.view(num_tokens, k, -1)
        total = pairs[:, 0].clone()
        for j in range(1, k):  # HF: zeros, then += each expert's share in id order
            total += pairs[:, j]
        return total


class SparseMoeBlock(nn.Module):
    """HF's `Qwen3VLMoeTextSparseMoeBlock` (checkpoint names `mlp.gate.weight`,
    `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = MoeRouter(config)
        self.experts = MoeExperts(config)

    def fuse_weights(self) -> None:
        """The experts' gate/up projections are stored fused already."""

    def pack(self, release_weight: bool = True) -> None:
        self.experts.pack(release_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts)


def is_moe_layer(config, layer_idx: int) -> bool:
    """transformers' rule: experts unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (1-based)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
