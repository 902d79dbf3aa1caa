"""The gated delta rule (Gated DeltaNet's linear attention), per sequence, in float32.

The recurrent state of one sequence is S: [v_heads, k_dim, v_dim]. Per token t (with q_t, k_t
L2-normalised, q_t scaled by k_dim^-0.5, decay a_t = exp(g_t) <= 1, write strength beta_t):

    S <- a_t * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule: write only the error)
    o_t = S^T q_t

Two forms compute it, as transformers computes them on CPU (the multi-token form is exact up to
float rounding, so greedy ids agree):

- `recurrent_gated_delta_rule`: the per-token update above, for a batch of decode rows (one
  token each), each row with its own state.
- `chunk_gated_delta_rule`: one sequence's chunk of prefill tokens, split in blocks of 64: inside
  a block the updates are solved at once (a unit lower-triangular system, the "UT transform"),
  across blocks the state is carried. It starts from the state the previous chunk left, so
  chunked prefill equals one-shot prefill.

Grouped heads: each q/k head serves v_heads / k_heads consecutive value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64  # tokens solved together in the chunked form (transformers' chunk_size)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's, as transformers has it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """[T, heads, dim] inputs -> float32 [v_heads, T, dim] (q normalised and scaled, k normalised),
    g and beta -> [v_heads, T]."""
    groups = v.shape[1] // k.shape[1]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=1)
        k = k.repeat_interleave(groups, dim=1)
    q, k, v = (x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v))
    g, beta = (x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format) for x in (g, beta))
    q = l2_normalize(q)
    k = l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens. q, k: [T, k_heads, k_dim]; v: [T, v_heads, v_dim]; g, beta:
    [T, v_heads]; state: [v_heads, k_dim, v_dim] float32 (zeros for a fresh sequence).
    Returns (out [T, v_heads, v_dim] in v's dtype, the state after the last token)."""
    out_dtype, num_tokens = v.dtype, q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (BLOCK - num_tokens % BLOCK) % BLOCK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads = v.shape[0]
    kb = k * beta.unsqueeze(-1)
    vb = v * beta.unsqueeze(-1)
    # [heads, blocks, BLOCK, dim]
    q, k, kb, vb = (x.reshape(heads, -1, BLOCK, x.shape[-1]) for x in (q, k, kb, vb))
    decay = g.reshape(heads, -1, BLOCK).cumsum(dim=-1)  # log of the decay since the block start
    future = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).triu(1)
    # pair[i, j] = decay between token j and token i of a block (i >= j), 0 above the diagonal
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * pair  # unit lower-triangular once the diagonal is 1
    scores = (q @ k.transpose(-1, -2)) * pair
    # Solve the block's updates at once: u = values to write, w = decayed keys reading the old state.
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = state.to(torch.float32)
    out = torch.zeros_like(u)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]  # [heads, blocks, 1, 1]
    for b in range(q.shape[1]):
        fresh = u[:, b] - w[:, b] @ state  # what the old state does not already predict
        out[:, b] = q[:, b] @ state + scores[:, b] @ fresh
        state = state * block_decay[:, b] + k[:, b].transpose(-1, -2) @ fresh
    out = out.reshape(heads, -1, out.shape[-1])[:, :num_tokens]
    return out.transpose(0, 1).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B rows. q, k: [B, k_heads, k_dim]; v: [B, v_heads, v_dim]; g, beta:
    [B, v_heads]; states: [B, v_heads, k_dim, v_dim] float32. Returns (out [B, v_heads, v_dim] in
    v's dtype, the new states)."""
    out_dtype = v.dtype
    groups = v.shape[1] // k.shape[1]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=1)
        k = k.repeat_interleave(groups, dim=1)
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    q = l2_normalize(q)
    k = l2_normalize(k)
    q = q / (q.shape[-1] ** 0.5)
    states = states.to(torch.float32) * g.exp()[..., None, None]
    predicted = (states * k.unsqueeze(-1)).sum(dim=-2)  # [B, heads, v_dim]
    delta = (v - predicted) * beta.unsqueeze(-1)
    states = states + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (states * q.unsqueeze(-1)).sum(dim=-2)
    return out.to(out_dtype), states
