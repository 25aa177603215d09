"""kernels/cpu_quant.linear: one packed matrix (a CPU load's attention projection, shared expert, head) through the
experts kernel's phase 2, against float64 from the `dequantize`d weights: `exact` (x as given) within ERR_EXACT of
the output's norm and `emulated` (x quantised per 32 as the kernel does) within ERR_EMULATED of its rms, the
tolerances of test_cpu_quant_kernel.py, whose module docstring says where they come from. One quantisation in
series here, not two, so the exact error is about half the experts'.
"""
import zlib

import pytest
import torch

from moedesk.kernels import cpu_quant as cq
from moedesk.kernels.quant_formats import dequantize
from tests.kernels.test_cpu_quant_kernel import (ERR_EMULATED, ERR_EXACT, FORMATS, built, maddubs_build,  # noqa: F401
                                                 path, q8_emulated, random_packed)

# K: whole blocks, and for q4_0 / q8_0 / mxfp4 a segment and a part (288 = 256 + 32, 320 = 256 + 64) and rows
# shorter than a segment; M: not a multiple of the kernel's 4 rows (7) and several work items (200).
SHAPES = [(f, k, m) for f in FORMATS for k, m in ([(96, 7), (288, 200), (320, 9)] if f in ("q4_0", "q8_0", "mxfp4")
                                                   else [(256, 7), (512, 200)])]


def case(fmt, k, m, n, dtype=torch.float32, bias=True, seed=()):
    g = torch.Generator().manual_seed(zlib.crc32(repr((fmt, k, m, n, *seed)).encode()))
    rows = random_packed(fmt, 1, m, k, g)[0]
    x = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(m, generator=g).to(dtype) if bias else None
    return x, rows, b


def check(y, x, rows, fmt, bias):
    w = dequantize(rows, fmt, x.shape[1], torch.float64)
    b = 0 if bias is None else bias.double()
    exact, emulated = x.double() @ w.T + b, q8_emulated(x) @ w.T + b
    rounding = 2 ** -7 if y.dtype == torch.bfloat16 else 0.0
    got = y.double()
    err_exact = float((got - exact).norm() / exact.norm())
    err_emulated = float((got - emulated).abs().max() / emulated.pow(2).mean().sqrt())
    assert err_exact < ERR_EXACT / 2 + rounding, err_exact
    assert err_emulated < ERR_EMULATED + 4 * rounding, err_emulated


@pytest.mark.parametrize("fmt,k,m", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 17, 40])
def test_linear_against_float64(path, fmt, k, m, n):
    """Every format, 1..40 rows of x (more than a pass of 32 tokens; from 8 on the AMX path's tiles), with a bias."""
    x, rows, bias = case(fmt, k, m, n)
    y = cq.linear(x, rows, fmt, bias)
    assert y.shape == (n, m) and y.dtype == torch.float32
    check(y, x, rows, fmt, bias)


@pytest.mark.parametrize("fmt", ["q4_0", "q6_k", "mxfp4"])
def test_linear_bf16_without_bias_and_strided_rows(path, fmt):
    """bf16 x (a view with a row stride wider than K) and output, no bias."""
    k = 288 if fmt != "q6_k" else 256
    x, rows, _ = case(fmt, k, 33, 5, bias=False)
    wide = torch.randn(5, k + 64).to(torch.bfloat16)
    wide[:, :k] = x.to(torch.bfloat16)
    view = wide[:, :k]
    y = cq.linear(view, rows, fmt)
    assert y.dtype == torch.bfloat16
    check(y, view, rows, fmt, None)


def test_linear_result_does_not_depend_on_rows_beside_it(path):
    """Each row of x is its own: one row alone gives the same bits as that row among many (the decode step and a
    verify of several drafted tokens agree)."""
    x, rows, bias = case("q4_k", 512, 200, 24)
    together = cq.linear(x, rows, "q4_k", bias)
    for i in (0, 9, 23):
        assert torch.equal(cq.linear(x[i:i + 1], rows, "q4_k", bias), together[i:i + 1])


def test_linear_bad_shapes_raise(built):
    x, rows, _ = case("q4_k", 256, 8, 2, bias=False)
    with pytest.raises(ValueError, match="cannot multiply"):
        cq.linear(x[:, :128], rows, "q4_k")  # K not whole super-blocks
    with pytest.raises(ValueError, match="cannot multiply"):
        cq.linear(torch.randn(2, 512), rows, "q4_k")  # rows of another width
    with pytest.raises(ValueError, match="cannot multiply"):
        cq.linear(x, rows, "q2_k")
    assert cq.linear(x[:0], rows, "q4_k").shape == (0, 8)


def test_linear_applies(built, monkeypatch):
    x, rows, _ = case("q8_0", 96, 8, 2, bias=False)
    assert cq.linear_applies(x, rows, "q8_0")
    assert not cq.linear_applies(x.half(), rows, "q8_0")
    assert not cq.linear_applies(x, rows, "q3_k")
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    assert not cq.linear_applies(x, rows, "q8_0")
