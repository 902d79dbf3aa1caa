"""The quantized panel GEMM (csrc/quant_panels_cpu.c, bf16 activations) against a reference:
both ways of running a panel (integers decoded in registers, and decoded once into bf16),
the panel layout's round trip, and `QuantizedLinear` choosing it only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmkit.layers import linear_panels, quant_panels
from mmkit.layers.quant_pack import from_int_values, quantize_int4, quantize_int8
from mmkit.layers.quantized_linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not quant_panels.available(), reason="no AVX512-BF16 quantized panel kernels in this build")


def _weights(n=80, k=128):
    torch.manual_seed(0)
    w = torch.randn(n, k)
    q = torch.randint(-128, 128, (n, k))
    zp = torch.randint(-5, 5, (n, k // 32))
    return {"int8": quantize_int8(w), "int4-g32": quantize_int4(w, 32), "int4-g64": quantize_int4(w, 64),
            "int4-g128": quantize_int4(w, 128), "int8-zeros-g32": from_int_values(q, torch.rand(n, k // 32), zp, 8, 32)}


@pytest.mark.parametrize("name", list(_weights()))
def test_pack_round_trip(name):
    qw = _weights()[name]
    back = quant_panels.unpack(quant_panels.pack(qw))
    assert back.bits == qw.bits and back.group_size == qw.group_size
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)


@pytest.mark.parametrize("n", [80, 96, 33])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 33])
@pytest.mark.parametrize("direct", [0, 64])
def test_gemm_matches_dequantized_reference(n, rows, direct):
    """direct=64: every row count in registers; direct=0: every panel decoded into bf16 first."""
    for name, qw in _weights(n).items():
        bias = torch.randn(n).bfloat16()
        run = quant_panels.bind(quant_panels.pack(qw), bias, direct)
        x = torch.randn(rows, qw.in_features).bfloat16()
        out = run(x)
        ref = F.linear(x.float(), qw.dequantize(torch.bfloat16).float(), bias.float())
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (name, err)


def test_decoded_path_is_the_bf16_panel_gemm_on_the_dequantized_weight():
    """Decoded once per call, a panel holds bf16((q - z) s) exactly as `dequantize` computes it,
    so the result is bit-identical to the bf16 panel GEMM on that weight."""
    for name, qw in _weights(96).items():
        x = torch.randn(20, qw.in_features).bfloat16()
        bias = torch.randn(96).bfloat16()
        out = quant_panels.bind(quant_panels.pack(qw), bias, 0)(x)
        dense = linear_panels.pack(qw.dequantize(torch.bfloat16))
        assert torch.equal(out, linear_panels.gemm(x, dense, 96, bias)), name


def test_exact_on_small_integers():
    """Integer x and weights with power-of-two scales: every product and sum is exact in float32,
    so both paths must give the integer result rounded once to bf16 (catches a wrong element order)."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (64, 64))
    z = torch.randint(0, 16, (64, 2))
    qw = from_int_values(q, torch.full((64, 2), 0.5), z, 4, 32)
    x = torch.randint(-3, 4, (3, 64)).bfloat16()
    ref = (x.float() @ qw.dequantize().T).bfloat16()
    for direct in (0, 8):
        assert torch.equal(quant_panels.bind(quant_panels.pack(qw), None, direct)(x), ref)


def test_strided_rows():
    qw = _weights()["int4-g32"]
    wide = torch.randn(5, 256).bfloat16()
    x = wide[:, :128]  # rows 256 apart
    run = quant_panels.bind(quant_panels.pack(qw), None)
    assert torch.equal(run(x), run(x.contiguous()))


def test_can_pack_refuses_what_the_kernel_does_not_run():
    qw = _weights()["int8"]
    assert quant_panels.can_pack(qw, torch.bfloat16)
    assert not quant_panels.can_pack(qw, torch.float32)  # float32 keeps the row-major kernels
    odd = from_int_values(torch.randint(-9, 9, (8, 9)), torch.rand(8, 1), None, 8, 9)
    assert not quant_panels.can_pack(odd, torch.bfloat16)


def test_layer_packs_for_bf16_only(monkeypatch):
    qw = _weights()["int4-g32"]
    x = torch.randn(2, 3, 128).bfloat16()
    bf16 = QuantizedLinear(qw, torch.randn(80).bfloat16())
    assert bf16.pack(torch.bfloat16) and bf16.panels is not None
    ref = F.linear(x.float(), qw.dequantize(torch.bfloat16).float(), bf16.bias.float())
    out = bf16(x)
    assert out.shape == (2, 3, 80) and ((out.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    assert torch.equal(bf16.qweight.dequantize(), qw.dequantize())  # rebuilt from the panels
    assert bf16.weight_nbytes() >= qw.nbytes() + 80 * 2  # the panels (padded) are what is held
    f32 = QuantizedLinear(qw, None)
    assert not f32.pack(torch.float32) and f32.panels is None
    monkeypatch.setenv("MMKIT_QUANT_PANELS", "0")
    off = QuantizedLinear(qw, None)
    assert not off.pack(torch.bfloat16) and off.panels is None


@pytest.mark.parametrize("amx_rows", [None, 2])
def test_amx_split_between_panels_and_onednn(monkeypatch, amx_rows):
    """On a CPU with AMX (linear_panels.BF16_MAX_ROWS set) a bf16 Linear keeps oneDNN's packed
    copy beside the panels and a QuantizedLinear its row-major integers, for calls with more rows;
    elsewhere the panels are the only copy. Both routes give the reference result."""
    from mmkit.models.llama import Linear

    monkeypatch.setattr(linear_panels, "BF16_MAX_ROWS", amx_rows)
    torch.manual_seed(3)
    dense = Linear(128, 80, bias=True).bfloat16()
    ref_w, ref_b = dense.weight.detach().float().clone(), dense.bias.detach().float().clone()
    dense.pack(release_weight=True)
    qw = _weights()["int4-g32"]
    quant = QuantizedLinear(qw, torch.randn(80).bfloat16())
    assert quant.pack(torch.bfloat16)
    assert (dense._onednn is not None) == (amx_rows is not None)
    assert (quant._qweight is not None) == (amx_rows is not None)
    for rows in (1, 2, 3, 20):
        x = torch.randn(rows, 128).bfloat16()
        ref = F.linear(x.float(), ref_w, ref_b)
        assert ((dense(x).float() - ref).abs().max() / ref.abs().max()) < 1e-2
        qref = F.linear(x.float(), qw.dequantize(torch.bfloat16).float(), quant.bias.float())
        assert ((quant(x).float() - qref).abs().max() / qref.abs().max()) < 1e-2
