"""The int8/int4 weight-only GEMM kernel against a torch reference (float32 and bf16 inputs),
the AVX-512 build and the portable one (MMKIT_KERNEL_GENERIC=1, in a child process)."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from mmkit.layers import cpu_kernels
from mmkit.layers.quant_pack import from_int_values, quantize_int4, quantize_int8
from mmkit.layers.quantized_linear import QuantizedLinear, dequantize, quant_gemm, quant_gemm_tiled

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")


def _weights():
    torch.manual_seed(0)
    w = torch.randn(80, 128)
    q = torch.randint(-128, 128, (80, 128))
    zp = torch.randint(-5, 5, (80, 4))
    return [quantize_int8(w), quantize_int4(w, 32), quantize_int4(w, 64), quantize_int4(w, 128),
            from_int_values(q, torch.rand(80, 4), zp, 8, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_kernel_matches_reference(dtype, rows):
    for qw in _weights():
        x = torch.randn(rows, 128).to(dtype)
        ref = x.double() @ qw.dequantize().double().T
        out = quant_gemm(x, qw)
        assert out is not None and out.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (qw.bits, qw.group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_is_bit_identical(dtype):
    """The prefill path's C dequantization equals the torch formula exactly (float32 parity
    with transformers on round-tripped weights depends on it)."""
    torch.manual_seed(1)
    odd = [quantize_int8(torch.randn(7, 100)), from_int_values(torch.randint(0, 16, (6, 96)), torch.rand(6, 2),
                                                               torch.randint(0, 16, (6, 2)), 4, 48)]
    for qw in _weights() + odd:
        assert torch.equal(dequantize(qw, dtype), qw.dequantize(dtype)), (qw.bits, qw.group_size, qw.in_features)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_kernel_matches_reference_wide(rows):
    """Shapes of a real decoder layer (K = 576: nine 64-column chunks, 18 int4 groups)."""
    torch.manual_seed(2)
    w = torch.randn(96, 576) * 0.02
    for qw in (quantize_int8(w), quantize_int4(w, 32), quantize_int4(w, 64), quantize_int4(w, 192)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            x = torch.randn(rows, 576).to(dtype)
            ref = x.double() @ qw.dequantize().double().T
            out = quant_gemm(x, qw)
            assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (qw.group_size, dtype)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_tiled_kernel_matches_bf16_reference(rows):
    """bf16 batches: the tiled kernel against F.linear on the bf16-rounded dequantized weight
    (the products are exact, only the order of float32 sums differs); column counts that are not
    a multiple of the tile's 8, int8 with zero points, int4 groups of 32 and 64."""
    torch.manual_seed(3)
    ws = _weights() + [quantize_int4(torch.randn(13, 64), 32), quantize_int8(torch.randn(21, 96))]
    for qw in ws:
        x = torch.randn(rows, qw.in_features).bfloat16()
        out = quant_gemm_tiled(x, qw)
        if out is None:
            assert not cpu_kernels.has_avx512()
            continue
        ref = torch.nn.functional.linear(x.float(), qw.dequantize(torch.bfloat16).float())
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()), (qw.bits, qw.group_size)


def test_layer_uses_dequantized_gemm_for_large_batches():
    qw = quantize_int4(torch.randn(64, 128), 32)
    layer = QuantizedLinear(qw, torch.randn(64))
    x = torch.randn(40, 128)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, qw.dequantize(), layer.bias), atol=1e-5)
    small = x[:2]
    assert torch.allclose(layer(small), torch.nn.functional.linear(small, qw.dequantize(), layer.bias), atol=1e-4)


def test_portable_build_agrees(tmp_path):
    # The test module by its own folder: another installed package may own the name `tests`.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import torch; from test_quant_kernels import test_kernel_matches_reference as t; "
            "from mmkit.layers import cpu_kernels; assert not cpu_kernels.has_avx512(); "
            "[t(d, r) for d in (torch.float32, torch.bfloat16) for r in (1, 5)]")
    env = {**os.environ, "MMKIT_KERNEL_GENERIC": "1", "MMKIT_REQUIRE_CPU_KERNELS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
