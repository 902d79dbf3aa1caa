"""The hybrid layers' two forms against transformers' own torch functions (float32): the chunked
gated delta rule and the one-token recurrent step, the short causal convolution over a chunk and
over one token; a sequence split into chunks (state and window carried) equals the one-shot pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmkit.layers.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from mmkit.layers.short_conv import causal_conv_chunk, causal_conv_step

KH, VH, KD, VD = 2, 4, 8, 6  # grouped: each key head serves two value heads


def _inputs(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, KH, KD, generator=gen)
    k = torch.randn(num_tokens, KH, KD, generator=gen)
    v = torch.randn(num_tokens, VH, VD, generator=gen)
    g = -F.softplus(torch.randn(num_tokens, VH, generator=gen))  # log decays <= 0
    beta = torch.rand(num_tokens, VH, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 150])
def test_chunked_form_equals_transformers(num_tokens):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(num_tokens)
    state0 = torch.randn(VH, KD, VD)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0)
    ref_out, ref_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                      initial_state=state0[None], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_out[0], rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state[0], rtol=0, atol=0)


def test_recurrent_step_equals_transformers_for_a_batch_of_rows():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs(5, seed=1)  # 5 rows, one token each, each with its own state
    states = torch.randn(5, VH, KD, VD)
    out, new = recurrent_gated_delta_rule(q, k, v, g, beta, states.clone())
    for i in range(5):
        ref_out, ref_state = torch_recurrent_gated_delta_rule(
            q[i:i + 1, None], k[i:i + 1, None], v[i:i + 1, None], g[i:i + 1, None], beta[i:i + 1, None],
            initial_state=states[i:i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[i], ref_out[0, 0], rtol=0, atol=0)
        torch.testing.assert_close(new[i], ref_state[0], rtol=0, atol=0)


def test_chunks_and_steps_carry_the_state():
    q, k, v, g, beta = _inputs(200, seed=2)
    zero = torch.zeros(VH, KD, VD)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, zero)
    parts, state = [], zero
    for lo, hi in [(0, 40), (40, 41), (41, 130), (130, 199)]:
        out, state = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        parts.append(out)
    out, state = recurrent_gated_delta_rule(q[199:], k[199:], v[199:], g[199:], beta[199:], state[None])
    parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[0], whole_state, rtol=1e-4, atol=1e-5)


def test_short_conv_equals_transformers_in_chunks_and_steps():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    channels, kernel, num_tokens = 12, 4, 30
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    ref = causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T  # zero-padded one-shot
    window = torch.zeros(channels, kernel - 1)
    parts = []
    for lo, hi in [(0, 2), (2, 17), (17, 27)]:  # a chunk shorter than the window, then longer ones
        out, window = causal_conv_chunk(x[lo:hi], window, weight, None, "silu")
        parts.append(out)
    for t in range(27, num_tokens):
        out, windows = causal_conv_step(x[t:t + 1], window[None], weight, None, "silu")
        window = windows[0]
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(window, x[-(kernel - 1):].T)  # the window: the last K-1 inputs
