"""The float32 fused CPU kernels (mmkit/layers/fused_f32.py) against the torch ops they replace:
the rotary embedding and the residual add bit-identical, RMSNorm and SiLU * up within float32
rounding; and MMKIT_FUSED_F32=0 turns them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmkit.layers import cpu_kernels, fused_f32
from mmkit.layers.norms import RMSNorm
from mmkit.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rotary_is_bit_identical(tokens):
    torch.manual_seed(0)
    heads, head_dim, max_pos = 5, 64, 512
    cos, sin = torch.randn(max_pos, head_dim), torch.randn(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (tokens,))
    x = torch.randn(tokens, heads + 2, head_dim)
    ref = apply_rotary(x[:, :heads], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    y = x.clone()
    assert fused_f32.rotary_(y, heads, positions, cos, sin)
    assert torch.equal(y[:, :heads], ref)
    assert torch.equal(y[:, heads:], x[:, heads:])  # heads past num_heads untouched


@pytest.mark.parametrize("tokens", [1, 128])
def test_rms_norm_with_residual(tokens):
    torch.manual_seed(1)
    hidden = 576
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x, res = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    summed = x + res
    ref = norm.weight * F.rms_norm(summed, (hidden,), None, 1e-5)
    out = fused_f32.rms_norm(x.clone(), norm.weight.detach(), 1e-5)
    assert torch.allclose(out, norm.weight * F.rms_norm(x, (hidden,), None, 1e-5), rtol=1e-6, atol=1e-6)
    xx = x.clone()
    out = fused_f32.rms_norm(xx, norm.weight.detach(), 1e-5, res)
    assert torch.equal(xx, summed)  # the residual stream: the same single rounding as x + res
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    # through the module: (normed, residual stream)
    got, stream = norm(x.clone(), res)
    assert torch.equal(stream, summed) and torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_silu_mul():
    torch.manual_seed(2)
    gate_up = torch.randn(9, 2 * 1536) * 4
    gate, up = gate_up.split(1536, dim=-1)
    out = fused_f32.silu_mul(gate_up)
    assert torch.allclose(out, F.silu(gate) * up, rtol=2e-6, atol=1e-7)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("MMKIT_FUSED_F32", "0")
    assert fused_f32.silu_mul(torch.randn(2, 8)) is None
    assert fused_f32.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None
    assert not fused_f32.rotary_(torch.randn(2, 1, 8), 1, torch.zeros(2, dtype=torch.long), torch.ones(4, 8),
                                 torch.ones(4, 8))
    # other dtypes and layouts are never taken
    monkeypatch.delenv("MMKIT_FUSED_F32")
    assert fused_f32.silu_mul(torch.randn(2, 8).double()) is None
    assert fused_f32.rms_norm(torch.randn(8, 2).T, torch.ones(8), 1e-6) is None
