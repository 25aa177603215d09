"""kernels.gpu_quant.packed_linear (one packed matrix, the experts' kernel with one group) and
engine.model.packed_linear.PackedLinear compute F.linear of the dequantised matrix.

The reference is kernels.quant_formats.dequantize and a float64 product, as in test_gpu_quant_kernel.py, whose
random packed rows (every bit of every field, small finite scales) and tolerances these reuse: in the interpreter
float32 x sums in float32 FMAs (1e-4 of the output's scale), fp16 x takes the tensor-core tiles (a few fp16 steps).
"""
import pytest
import torch
import torch.nn.functional as F

from moedesk.kernels.quant_formats import dequantize
from tests.kernels.test_gpu_quant_kernel import Q8_TOLERANCE, assert_close, interpreted, random_stack

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from moedesk.engine.model import packed_linear  # noqa: E402
from moedesk.engine.model.packed_linear import PackedLinear, replace_linear, route  # noqa: E402
from moedesk.kernels import gpu_quant  # noqa: E402

# (format, rows, k): rows not a multiple of the interpreter's 128-row tile; k of partial steps along a row
CASES = [("q4_0", 160, 96), ("q8_0", 136, 160), ("q4_k", 144, 256), ("q5_k", 130, 512), ("q6_k", 150, 256),
         ("mxfp4", 160, 96)]


def matrix(fmt, rows, k, seed=0, device="cpu"):
    return random_stack(1, rows, k, fmt, device, seed)[0]


def reference(x, rows, fmt, k, bias=None):
    y = x.double() @ dequantize(rows, fmt, k).double().T
    return y if bias is None else y + bias.double()


@interpreted
@pytest.mark.parametrize("fmt,rows,k", CASES)
@pytest.mark.parametrize("m", [1, 3])
def test_one_matrix_float32_rows(fmt, rows, k, m):
    # Decode's rows: float32 FMAs, one or a few tokens a pass over the weights.
    w = matrix(fmt, rows, k, seed=rows + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = gpu_quant.packed_linear(x, w, fmt)
    assert got.dtype == torch.float32 and got.shape == (m, rows)
    assert_close(got, reference(x, w, fmt, k), 1e-4, 1e-5)


@interpreted
@pytest.mark.parametrize("fmt,rows,k", CASES)
def test_one_matrix_tensor_core_tiles_with_bias(fmt, rows, k, monkeypatch):
    # 16-bit x of several rows: the tensor-core tiles (fp16 in the interpreter), the bias added in float32. Up to 8
    # rows take the integer route by default (test_gpu_quant_q8.py); here the tiles.
    monkeypatch.setattr(gpu_quant, "_Q8_WANTED", False)
    w = matrix(fmt, rows, k, seed=7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, k, generator=g).to(torch.float16)
    bias = torch.randn(rows, generator=g).to(torch.float16)
    got = gpu_quant.packed_linear(x, w, fmt, bias)
    assert got.dtype == torch.float16 and got.shape == (6, rows)
    assert_close(got, reference(x, w, fmt, k, bias), 2 ** -8, 2 ** -9, 2 ** -10)


def test_integer_route_for_up_to_8_rows_and_beyond_for_matrices_too_small_for_the_float_tiles():
    h200 = 132
    assert gpu_quant.linear_takes_q8(8, 201088, h200)  # gpt-oss-20b's head at 8 sequences
    assert not gpu_quant.linear_takes_q8(16, 201088, h200)  # ... at 16: 3,142 float programs
    assert gpu_quant.linear_takes_q8(16, 5120, h200)  # its q/k/v projection: 80 float programs
    assert gpu_quant.linear_takes_q8(31, 2880, h200)
    assert not gpu_quant.linear_takes_q8(16, 32000, h200)  # Mixtral's head: 500 float programs
    assert not gpu_quant.linear_takes_q8(gpu_quant.LINEAR_ROWS, 2880, h200)  # prefill: dequantised, cuBLAS
    assert gpu_quant.linear_takes_q8(16, 6144, h200)  # its q/k/v projection: 96


@interpreted
@pytest.mark.parametrize("m,q8", [(6, True), (12, False)])
def test_one_matrix_of_several_16_bit_rows_takes_the_integer_route_up_to_8(m, q8, monkeypatch):
    calls = []
    launch = gpu_quant._launch_q8
    monkeypatch.setattr(gpu_quant, "_launch_q8", lambda *a, **kw: calls.append(kw["m"]) or launch(*a, **kw))
    w = matrix("q8_0", 136, 160, seed=9)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).to(torch.float16)
    got = gpu_quant.packed_linear(x, w, "q8_0")
    assert calls == ([m] if q8 else [])
    assert gpu_quant.takes_q8(x, w, "q8_0", m, 1, linear=True) == q8
    assert_close(got, reference(x, w, "q8_0", 160), *(Q8_TOLERANCE if q8 else (2 ** -8, 2 ** -9, 2 ** -10)))


def test_packed_linear_refuses_rows_of_another_width():
    w = matrix("q8_0", 8, 64)
    with pytest.raises(ValueError, match="do not hold 96 weights"):
        gpu_quant.packed_linear(torch.randn(1, 96), w, "q8_0")


def test_route_kernel_for_few_rows_on_cuda_and_every_row_count_on_the_cpu():
    assert route(True, True, 1) == "kernel"
    assert route(True, True, gpu_quant.LINEAR_ROWS - 1) == "kernel"
    assert route(True, True, gpu_quant.LINEAR_ROWS) == "dequant"  # prefill: dequantised, cuBLAS
    assert route(True, False, 1) == "dequant"  # the kernel does not apply (no Triton, fused kernels off)
    assert route(False, True, 1) == route(False, True, 4 * gpu_quant.LINEAR_ROWS) == "kernel"  # cpu_quant.linear
    assert route(False, False, 1) == "dequant"  # the CPU kernel is not built here


@pytest.mark.parametrize("fmt,rows,k", CASES)
def test_module_on_the_cpu_is_the_native_kernel_or_dequantise_then_linear(fmt, rows, k, monkeypatch):
    from moedesk.kernels import cpu_quant

    w = matrix(fmt, rows, k, seed=1)
    bias = torch.randn(rows)
    layer = PackedLinear(w, fmt, k, bias, dtype=torch.float32)
    x = torch.randn(2, 5, k)
    if cpu_quant.available():
        assert torch.equal(layer(x), cpu_quant.linear(x.reshape(10, k), w, fmt, bias).view(2, 5, rows))
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # without the kernel: exact
    expected = F.linear(x, dequantize(w, fmt, k), bias)
    assert torch.equal(layer(x), expected)
    # dequantised a slice of rows at a time: the same dot products, BLAS may sum them in another order
    monkeypatch.setattr(packed_linear, "_DEQUANT_CHUNK", 3 * k)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer.weight.shape == (rows, k) and torch.equal(layer.weight, dequantize(w, fmt, k))


def test_joined_rows_compute_the_parts_side_by_side_and_are_held_once():
    k = 64
    parts = [PackedLinear(matrix("q8_0", n, k, seed=n), "q8_0", k, torch.randn(n)) for n in (32, 8, 8)]
    x = torch.randn(3, k)
    expected = torch.cat([p(x) for p in parts], dim=-1)
    joined = PackedLinear.joined(parts)
    assert torch.equal(joined(x), expected)
    assert all(p.packed.untyped_storage().data_ptr() == joined.packed.untyped_storage().data_ptr() for p in parts)
    with pytest.raises(ValueError, match="share a format"):
        PackedLinear.joined([parts[0], PackedLinear(matrix("q4_0", 8, k), "q4_0", k)])


def test_replace_linear_keeps_the_bias_and_checks_the_shape():
    model = torch.nn.Sequential(torch.nn.Linear(64, 16))
    bias = model[0].bias
    packed = replace_linear(model, "0.weight", matrix("q4_0", 16, 64), "q4_0", 64)
    assert model[0] is packed and packed.bias is bias
    assert dict(model.named_parameters()) == {"0.bias": bias}
    assert [n for n, _ in model.named_buffers()] == ["0.packed"]
    with pytest.raises(ValueError, match="for a 16 x 64 Linear"):
        replace_linear(torch.nn.Sequential(torch.nn.Linear(64, 16)), "0.weight", matrix("q4_0", 8, 64), "q4_0", 64)


def test_packable_weights():
    assert packed_linear.packable("layers.0.attn.wq.weight") and packed_linear.packable("lm_head.weight")
    assert packed_linear.packable("layers.3.moe.shared.down.weight") and packed_linear.packable("layers.0.mlp.up.weight")
    for name in ("embed.weight", "layers.1.moe.router.weight", "layers.1.moe.shared_gate.weight",
                 "layers.0.attn.wkv_b.weight", "layers.0.attn.in_qkv.weight", "layers.0.attn.wq.bias"):
        assert not packed_linear.packable(name), name


# ---------------------------------------------------------------- the GPU box

BF16_TOLERANCE = (2 ** -5, 2 ** -7, 2 ** -7)  # test_gpu_quant_kernel.py's, for bf16 operands and output


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 200])
def test_module_on_cuda(fmt, m):
    dev = torch.device("cuda")
    k, rows = (4096, 6144) if fmt != "mxfp4" else (2880, 5120)
    w = matrix(fmt, rows, k, seed=5, device=dev)
    bias = torch.randn(rows, device=dev).to(torch.bfloat16)
    layer = PackedLinear(w, fmt, k, bias)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    assert route(True, gpu_quant.linear_applies(x, w, fmt), m) == ("kernel" if m < 32 else "dequant")
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, rows)
    routed = gpu_quant.takes_q8(x, w.unsqueeze(0), fmt, m, 1, linear=True)
    assert routed == (m <= 16)  # 80 or 96 programs of the float tiles, under 2 an SM on an H200
    assert_close(got, reference(x, w, fmt, k, bias), *(Q8_TOLERANCE if routed else BF16_TOLERANCE))


@pytest.mark.gpu
def test_module_captured_in_a_cuda_graph():
    dev = torch.device("cuda")
    w = matrix("q4_k", 4096, 4096, seed=6, device=dev)
    layer = PackedLinear(w, "q4_k", 4096)
    x = torch.randn(1, 4096, device=dev).to(torch.bfloat16)
    layer(x)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn(1, 4096, device=dev))
    graph.replay()
    assert_close(out, reference(x, w, "q4_k", 4096), *Q8_TOLERANCE)  # one row of q4_k: the integer route
