"""The C linear kernels against torch: the float32 GEMV (`cpu_kernels.dense_gemv`) and the bf16
panel GEMM (`layers/linear_panels.py`), on the shapes a model sends (few and many rows, widths
that are not multiples of the kernels' blocks, strided rows, bias), and `Linear` choosing them."""

import pytest
import torch
import torch.nn.functional as F

from mmkit.layers import cpu_kernels, linear_panels
from mmkit.models.llama import GEMV_MAX_ROWS, Linear

needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None, reason="the C kernels did not build")
needs_panels = pytest.mark.skipif(not linear_panels.available(), reason="needs the panel kernels (AVX512-BF16 or AVX2)")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 33), (1, 7), (130, 600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_gemv_f32_matches_torch(m, n, k, with_bias):
    w = torch.randn(n, k, generator=_gen(1))
    b = torch.randn(n, generator=_gen(2)) if with_bias else None
    base = torch.randn(m, k + 5, generator=_gen(3))
    x = base[:, 2:k + 2]  # rows k + 5 apart: the kernel takes strided rows
    out = cpu_kernels.dense_gemv(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # float32 sums in another order than MKL's (the portable build: one running sum over K)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_dense_gemv_refuses_what_it_cannot_run():
    w = torch.randn(8, 16)
    assert cpu_kernels.dense_gemv(torch.randn(2, 16).t().contiguous().t(), w) is None  # columns strided
    assert cpu_kernels.dense_gemv(torch.randn(2, 15), w) is None                      # K mismatch
    assert cpu_kernels.dense_gemv(torch.randn(2, 16, dtype=torch.float64), w) is None  # dtype
    assert cpu_kernels.dense_gemv(torch.randn(2, 16), w.t().contiguous().t()) is None  # weight not dense


@needs_panels
def test_panels_round_trip_and_zero_padding():
    w = torch.randn(45, 10, generator=_gen(4)).bfloat16()
    panels = linear_panels.pack(w)
    assert panels.shape == (2, 5, 32, 2)
    assert torch.equal(linear_panels.unpack(panels, 45), w)
    assert torch.equal(panels[1, :, 13:], torch.zeros(5, 19, 2, dtype=torch.bfloat16))  # rows past N


@needs_panels
def test_float32_panels_round_trip():
    w = torch.randn(45, 11, generator=_gen(12))
    panels = linear_panels.pack(w)
    if linear_panels.f32_halves():  # AVX2 builds: [P, 2, K, 16]
        assert panels.shape == (2, 2, 11, 16)
        assert torch.equal(panels[0, 1, 4], w[16:32, 4]) and torch.equal(panels[1, 0, :, 13:], torch.zeros(11, 3))
    else:
        assert panels.shape == (2, 11, 32)
    assert torch.equal(linear_panels.unpack(panels, 45), w)


@needs_panels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 130, 300])
@pytest.mark.parametrize("n,k", [(96, 64), (45, 11), (33, 599)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_panel_gemm_matches_torch(m, n, k, with_bias):
    """Without a bias, whole panels of float32 output are written in place by the AVX2 kernel
    (no copy); with one, or for the last, partial panel (n = 45, 33), through a buffer."""
    w = torch.randn(n, k, generator=_gen(13))
    b = torch.randn(n, generator=_gen(14)) if with_bias else None
    x = torch.randn(m, k + 3, generator=_gen(15))[:, :k]
    out = linear_panels.gemm(x, linear_panels.pack(w), n, b)
    ref = F.linear(x.double(), w.double(), b.double() if with_bias else None)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


@needs_panels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 130, 300])
@pytest.mark.parametrize("n,k", [(96, 64), (45, 10), (33, 598)])
def test_panel_gemm_matches_float_reference(m, n, k):
    """Within bf16 rounding of the float64 result: the products are exact in float32 and only
    the order of the float32 sums differs from oneDNN's."""
    w = torch.randn(n, k, generator=_gen(5)).bfloat16()
    b = torch.randn(n, generator=_gen(6)).bfloat16()
    x = torch.randn(m, k + 4, generator=_gen(7)).bfloat16()[:, :k]
    out = linear_panels.gemm(x, linear_panels.pack(w), n, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # one bf16 rounding of the result (2^-8 relative) plus float32 sums (far below it)
    torch.testing.assert_close(out.double(), ref, atol=1e-3 * ref.abs().max().item(), rtol=2 ** -8)
    # the rounding of an exact float32 sum, where the sum is exact: small integers
    wi = torch.randint(-3, 4, (n, k), generator=_gen(8)).bfloat16()
    xi = torch.randint(-3, 4, (m, k), generator=_gen(9)).bfloat16()
    got = linear_panels.gemm(xi, linear_panels.pack(wi), n, None)
    assert torch.equal(got, (xi.float() @ wi.float().t()).bfloat16())


@needs_panels
def test_linear_uses_panels_and_releases_the_row_major_copy():
    lin = Linear(64, 45, bias=True).to(torch.bfloat16)
    ref_w, ref_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack(release_weight=True)
    assert lin._panels and lin.weight.numel() == 0
    assert lin._packed.numel() == 2 * 32 * 64  # two panels: 45 rows padded to 64
    for shape in ((1, 64), (7, 64), (2, 3, 64)):
        x = torch.randn(*shape, generator=_gen(10)).bfloat16()
        torch.testing.assert_close(lin(x), F.linear(x, ref_w, ref_b), atol=3e-2, rtol=2e-2)
    # a float32 input still runs (through the bf16 copy, as with oneDNN's packed weight)
    assert lin(torch.randn(2, 64)).dtype == torch.float32


@needs_panels
def test_float32_linear_packs_panels():
    lin = Linear(40, 24)
    ref_w, ref_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack(release_weight=True)
    assert lin._panels and lin._packed.dtype == torch.float32 and lin.weight.numel() == 0
    for m in (1, 16, 40):
        x = torch.randn(m, 40, generator=_gen(16))
        torch.testing.assert_close(lin(x), F.linear(x, ref_w, ref_b), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_float32_linear_runs_the_gemv_for_few_rows_without_panels(monkeypatch):
    monkeypatch.setenv("MMKIT_LINEAR_PANELS", "0")
    lin = Linear(40, 24)
    lin.pack()
    assert lin._packed is None  # float32 keeps its row-major weight
    calls = []
    real = cpu_kernels.dense_gemv
    monkeypatch.setattr(cpu_kernels, "dense_gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 40, generator=_gen(11))
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, GEMV_MAX_ROWS]  # more rows: F.linear


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,with_bias", [(70, True), (64, False)])
def test_panel_gemm_rows_do_not_depend_on_their_batch(dtype, n, with_bias):
    """Each output row is bit-identical whether its row of x runs alone (the batch-1 kernel) or
    among 300 others (the blocked kernels, several chunks, the first block of each prefetching
    the panel, whole float32 panels written in place when there is no bias): every path sums
    each column in the same order, so a request's result does not depend on what shares its step."""
    k = 598
    w = torch.randn(n, k, generator=_gen(21)).to(dtype)
    b = torch.randn(n, generator=_gen(22)).to(dtype) if with_bias else None
    x = torch.randn(301, k, generator=_gen(23)).to(dtype)
    panels = linear_panels.pack(w)
    batched = linear_panels.gemm(x, panels, n, b)
    for i in (0, 1, 5, 77, 78, 150, 300):
        assert torch.equal(linear_panels.gemm(x[i:i + 1], panels, n, b)[0], batched[i]), i
    assert torch.equal(linear_panels.gemm(x[3:10], panels, n, b), batched[3:10])


needs_fused_silu = pytest.mark.skipif(
    cpu_kernels.library() is None or not cpu_kernels.library().mmkit_panel_gemm_silu_mul_takes(576, 64),
    reason="the fused SiLU-mul GEMM needs the AVX512-BF16 panel kernels")


def _silu_mul_two_passes(x, panels, inter, b):
    """The unfused path: the gate/up GEMM, then the SiLU-mul kernel on its output."""
    gate_up = linear_panels.gemm(x, panels, 2 * inter, b)
    if x.dtype == torch.bfloat16:
        return cpu_kernels.silu_mul_bf16(gate_up)
    from mmkit.layers import fused_f32
    return fused_f32.silu_mul(gate_up)


@needs_fused_silu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,k,with_bias", [(32, 2, True), (64, 96, False), (96, 598, True), (320, 1024, False)])
def test_fused_silu_mul_is_bit_identical_to_the_two_passes(dtype, inter, k, with_bias):
    """The gate/up GEMM with SiLU-mul in its epilogue gives the same bits as the GEMM followed by
    the SiLU-mul kernel, at every row count (1-6 rows per block, partial blocks, several
    256-row chunks, strided rows), with and without bias; and close to silu(gate) * up in
    float64 (so the two passes are not merely equal to each other)."""
    w = (0.1 * torch.randn(2 * inter, k, generator=_gen(31))).to(dtype)
    b = (0.5 * torch.randn(2 * inter, generator=_gen(32))).to(dtype) if with_bias else None
    panels = linear_panels.pack(w)
    fused = linear_panels.bind_silu_mul(panels, inter, b)
    assert fused is not None
    x_all = torch.randn(301, k + 6, generator=_gen(33)).to(dtype)[:, :k]  # strided rows
    for m in (1, 5, 6, 7, 13, 256, 257, 301):
        x = x_all[:m]
        got = fused(x)
        assert got.shape == (m, inter) and got.dtype == dtype
        assert torch.equal(got, _silu_mul_two_passes(x, panels, inter, b)), m
    gate_up = F.linear(x_all.double(), w.double(), None if b is None else b.double())
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_fused_silu
def test_fused_silu_mul_refuses_what_it_cannot_run():
    """An up panel must start on a panel boundary (inter a multiple of 32), the panels must be
    a [gate | up] pair of that width and K at most where the fused pass was measured to pay
    (1024): otherwise None, and the caller runs the two passes."""
    w = torch.randn(2 * 40, 64, generator=_gen(34)).bfloat16()
    assert linear_panels.bind_silu_mul(linear_panels.pack(w), 40, None) is None
    w = torch.randn(2 * 64, 64, generator=_gen(35)).bfloat16()
    assert linear_panels.bind_silu_mul(linear_panels.pack(w), 32, None) is None  # not [gate | up] of 32
    assert linear_panels.bind_silu_mul(linear_panels.pack(w), 64, None) is not None
    w = torch.randn(2 * 64, 1536, generator=_gen(37)).bfloat16()
    assert linear_panels.bind_silu_mul(linear_panels.pack(w), 64, None) is None  # K past where it pays


@needs_fused_silu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [64, 40])
def test_llama_mlp_runs_silu_mul_in_the_gemm_epilogue(monkeypatch, dtype, inter):
    """LlamaMLP takes the fused kernel when its width allows (64) and the two passes otherwise
    (40); both give the unfused path's bits."""
    from types import SimpleNamespace

    from mmkit.layers import fused_f32
    from mmkit.models.llama import LlamaMLP

    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=48, intermediate_size=inter, hidden_act="silu", mlp_bias=False)
    mlp = LlamaMLP(cfg).to(dtype)
    x = torch.randn(9, 48, generator=_gen(36)).to(dtype)
    mlp.fuse_weights()
    for m in mlp.modules():
        if isinstance(m, Linear):
            m.pack()
    gate_up = mlp.gate_up_proj(x)
    act = cpu_kernels.silu_mul_bf16(gate_up) if dtype == torch.bfloat16 else fused_f32.silu_mul(gate_up)
    two_passes = mlp.down_proj(act)
    fused_runs, kernel_calls = [], []
    real_fused, real_kernel = mlp.gate_up_proj._run_silu_mul, cpu_kernels.silu_mul_bf16
    assert (real_fused is not None) == (inter % 32 == 0)
    if real_fused is not None:
        monkeypatch.setattr(mlp.gate_up_proj, "_run_silu_mul", lambda x: fused_runs.append(x.shape[0]) or real_fused(x))
    monkeypatch.setattr(cpu_kernels, "silu_mul_bf16", lambda g: kernel_calls.append(g.shape[0]) or real_kernel(g))
    assert torch.equal(mlp(x), two_passes)
    assert fused_runs == ([9] if inter % 32 == 0 else [])
    # the two passes ran only where the fused kernel could not (bf16's SiLU-mul kernel counted)
    assert kernel_calls == ([9] if inter % 32 and dtype == torch.bfloat16 else [])
