"""Experts computed on the GPU from pinned host stacks (kernels.gpu_zero_copy) compute expert_forward, and packed
stacks what the resident packed kernel (kernels.gpu_quant) computes.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is
no GPU), in float32, which checks the indexing and the formulas; the GPU test reads real pinned memory in bf16.
"""
import os

import pytest
import torch

from moedesk.kernels.cpu_experts import expert_forward
from moedesk.kernels.expert_weights import ExpertWeights

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from moedesk.kernels import gpu_zero_copy  # noqa: E402


def _stacks(e, f, h, dtype, pinned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * f, h, generator=g) / h ** 0.5).to(dtype)
    down = (torch.randn(e, h, f, generator=g) / f ** 0.5).to(dtype)
    x = torch.randn(3, h, generator=g).to(dtype)
    if pinned:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    return x, ExpertWeights(gate_up, down, h, f)


def _expected(x, ids, w):
    k, gate_up, down = ids.shape[1], w.gate_up, w.down
    rows = [expert_forward(x[t:t + 1], gate_up[ids[t, r]], down[ids[t, r]]) for t in range(len(x)) for r in range(k)]
    return torch.cat(rows)


@pytest.mark.parametrize("f,h,first_rank", [(40, 72, 2), (16, 32, 0), (24, 2100, 3)])  # partial blocks; H > 2048
def test_zero_copy_experts_interpreted(f, h, first_rank):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    x, w = _stacks(6, f, h, torch.float32)
    ids = torch.tensor([[0, 2, 3, 5], [1, 2, 4, 5], [0, 1, 3, 4]])
    out = torch.full((12, h), 7.0)
    gpu_zero_copy.zero_copy_experts(x, ids, first_rank, w, out)
    expected = _expected(x, ids, w).view(3, 4, h)
    got = out.view(3, 4, h)
    torch.testing.assert_close(got[:, first_rank:], expected[:, first_rank:], rtol=1e-5, atol=1e-5)
    assert (got[:, :first_rank] == 7.0).all()  # the ranks below first_rank are the CPU's: untouched


def test_applies_only_to_a_cuda_input_and_pinned_stacks():
    x, w = _stacks(2, 8, 16, torch.float32)
    assert not gpu_zero_copy.applies(x.device, w)


@pytest.mark.gpu
def test_the_knob_turns_zero_copy_off(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, w = _stacks(2, 8, 16, torch.bfloat16, pinned=True)
    cuda = torch.device("cuda")
    assert gpu_zero_copy.applies(cuda, w)
    monkeypatch.setenv("MOEDESK_NO_ZERO_COPY", "1")
    assert not gpu_zero_copy.applies(cuda, w)


@pytest.mark.gpu
def test_zero_copy_experts_read_pinned_memory_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x, w = _stacks(8, 768, 2048, torch.bfloat16, pinned=True)
    x = x.cuda()
    assert gpu_zero_copy.applies(x.device, w)
    ids = torch.tensor([[0, 3, 6, 7], [1, 2, 3, 4], [2, 5, 6, 7]], device="cuda")
    out = torch.zeros(12, 2048, dtype=torch.bfloat16, device="cuda")
    gpu_zero_copy.zero_copy_experts(x, ids, 1, w, out)
    expected = _expected(x, ids, w.to("cuda")).view(3, 4, -1)
    got = out.view(3, 4, -1)
    assert (got[:, 0] == 0).all()
    # float32 sums in another order than cuBLAS: a rounding step apart at most, rarely.
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=2 ** -6, atol=2 ** -8)
    assert (got[:, 1:] != expected[:, 1:]).float().mean() < 0.05


# ---------------------------------------------------------------- packed stacks

def _packed_reference(x, ids, w, first_rank):
    """Each streamed pair's expert dequantised and applied in float64: [N, K - first_rank, H]."""
    from tests.kernels.test_gpu_quant_kernel import reference

    rows = [reference(x[t:t + 1], w.select([int(ids[t, r])]), [1]) for t in range(len(x))
            for r in range(first_rank, ids.shape[1])]
    return torch.cat(rows).view(len(x), ids.shape[1] - first_rank, -1)


@pytest.mark.parametrize("formats,hidden,width", [(("q4_0",), 160, 96), (("q8_0",), 96, 160),
                                                  (("q4_k", "q6_k"), 256, 512), (("q5_k",), 256, 256)])
def test_zero_copy_packed_experts_interpreted(formats, hidden, width):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close, random_experts

    w = random_experts(5, hidden, width, *formats, seed=hidden)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[4, 0, 2], [1, 3, 4]])
    out = torch.full((6, hidden), 7.0)
    gpu_zero_copy.zero_copy_experts(x, ids, 1, w, out)
    got = out.view(2, 3, hidden)
    assert (got[:, 0] == 7.0).all()  # rank 0 is the CPU's
    assert_close(got[:, 1:], _packed_reference(x, ids, w, 1), 1e-4, 1e-5)


def test_packed_stacks_apply_in_the_formats_the_gpu_reads():
    from tests.kernels.test_gpu_quant_kernel import random_experts

    w = random_experts(2, 64, 64, "q4_0")
    assert not gpu_zero_copy.applies(torch.device("cpu"), w)  # pinned or not, a CPU input never streams


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [("q4_0",), ("q4_k", "q6_k"), ("q8_0",)])
def test_zero_copy_packed_experts_equal_resident_ones_on_cuda(formats, monkeypatch):
    """A packed expert streamed from pinned RAM computes what the same expert resident on the GPU computes on
    kernels.gpu_quant's float32 one-row path (the same arithmetic, so equal up to float32 summation order; q4_k's
    resident rows take the integer route by default, which rounds x)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from moedesk.kernels import gpu_quant
    monkeypatch.setattr(gpu_quant, "_Q8_WANTED", False)
    from tests.kernels.test_gpu_quant_kernel import assert_close, random_experts

    host = random_experts(8, 2048, 768, *formats, seed=5)
    host = ExpertWeights(host.gate_up.pin_memory(), host.down.pin_memory(), host.hidden, host.width,
                         host.gate_up_format, host.down_format)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    assert gpu_zero_copy.applies(x.device, host)
    ids = torch.tensor([[6, 1, 3, 7]], device="cuda")
    out = torch.zeros(4, 2048, dtype=torch.bfloat16, device="cuda")
    gpu_zero_copy.zero_copy_experts(x, ids, 1, host, out)
    assert (out[0] == 0).all()
    resident = host.to("cuda")
    for r in range(1, 4):
        one = resident.expert(int(ids[0, r]))
        expected = gpu_quant.expert_forward(x, one)
        assert_close(out[r:r + 1].float(), expected.double(), 2 ** -7, 2 ** -8, 2 ** -7)


# ---------------------------------------------------------------- the tail of the rows (a split with the CPU)

def _rows_reference(x, ids, w: ExpertWeights, first_row: int):
    """Each pair's expert over intermediate rows [first_row, F) only, dequantised, in float64: [N*K, H]. gpt-oss's
    function where w has it: the gate/up biases of those rows, and the whole down bias (the GPU's part adds it)."""
    gate_up, down = (t.double() for t in w.dense(torch.float32))
    f = w.width
    rows = []
    for t in range(len(x)):
        for e in ids[t].tolist():
            h = x[t:t + 1].double() @ gate_up[e].T
            if w.gate_up_bias is not None:
                h += w.gate_up_bias[e].double()
            gate, up = h[:, first_row:f], h[:, f + first_row:]
            act = w.glu(gate, up) if w.glu is not None else torch.nn.functional.silu(gate) * up
            y = act @ down[e][:, first_row:].T
            rows.append(y if w.down_bias is None else y + w.down_bias[e].double())
    return torch.cat(rows)


def _gpt_oss(w: ExpertWeights, seed=0) -> ExpertWeights:
    from tests.kernels.test_gpu_quant_kernel import gpt_oss_function

    return gpt_oss_function(w, limit=0.75, seed=seed)


@pytest.mark.parametrize("formats,hidden,width,first_row", [((), 72, 96, 0), ((), 40, 64, 32),
                                                            (("mxfp4",), 96, 160, 0), (("mxfp4",), 96, 160, 64)])
def test_zero_copy_gpt_oss_experts_interpreted(formats, hidden, width, first_row):
    """gpt-oss's biased, clamped experts streamed, whole (first_row 0) or their tail rows, dense and MXFP4."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close, random_experts

    if formats:
        w = _gpt_oss(random_experts(5, hidden, width, *formats, seed=hidden), seed=1)
    else:
        _, w = _stacks(5, width, hidden, torch.float32, seed=width)
        w = _gpt_oss(w, seed=2)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[4, 0, 2], [1, 3, 4]])
    out = torch.full((6, hidden), 7.0) if not first_row else torch.zeros(6, hidden)
    first_rank = 0 if first_row else 1
    gpu_zero_copy.zero_copy_experts(x, ids, first_rank, w, out, first_row=first_row)
    expected = _rows_reference(x, ids, w, first_row).view(2, 3, hidden)
    got = out.view(2, 3, hidden)
    assert (got[:, :first_rank] == 7.0).all()
    assert_close(got[:, first_rank:], expected[:, first_rank:], 1e-4, 1e-5)
    if first_row == 0:  # the whole expert: transformers' GptOssExperts on the same weights
        from tests.kernels.test_gpu_quant_kernel import transformers_reference

        theirs = torch.cat([transformers_reference(x[t:t + 1], w.select([int(e)]), [1])
                            for t in range(2) for e in ids[t, first_rank:]])
        assert_close(got[:, first_rank:].reshape(-1, hidden), theirs, 1e-4, 1e-5)


@pytest.mark.parametrize("formats,hidden,width,first_row", [
    ((), 72, 96, 32), ((), 40, 64, 32),  # dense: rows not a multiple of the program's tile
    (("q4_0",), 160, 96, 64), (("q8_0",), 96, 160, 32), (("q4_k", "q6_k"), 256, 768, 256),
    (("q5_k",), 256, 512, 256)])
def test_zero_copy_tail_rows_interpreted(formats, hidden, width, first_row):
    """first_row > 0: the GPU's part of every pair, rows [first_row, F) (the CPU computes rows [0, first_row):
    tests/offload/test_split_width.py checks the two together)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close, random_experts

    if formats:
        w = random_experts(5, hidden, width, *formats, seed=hidden)
    else:
        _, w = _stacks(5, width, hidden, torch.float32, seed=width)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[4, 0, 2], [1, 3, 4]])
    out = torch.zeros(6, hidden)
    gpu_zero_copy.zero_copy_experts(x, ids, 0, w, out, first_row=first_row)
    tail = _rows_reference(x, ids, w, first_row)
    assert_close(out, tail, 1e-4, 1e-5)
    assert (tail - _rows_reference(x, ids, w, 0)).abs().max() > 1e-3  # rows [0, first_row) were left out


def test_zero_copy_rows_must_be_whole_blocks():
    from tests.kernels.test_gpu_quant_kernel import random_experts

    w = random_experts(2, 256, 512, "q4_k")
    assert gpu_zero_copy.row_granule(w) == 256
    with pytest.raises(ValueError, match="multiple of 256"):
        gpu_zero_copy.zero_copy_experts(torch.zeros(1, 256), torch.zeros(1, 1, dtype=torch.long), 0, w,
                                      torch.zeros(1, 256), first_row=128)


@pytest.mark.gpu
def test_zero_copy_gpt_oss_experts_equal_resident_ones_on_cuda():
    """gpt-oss-120b's MXFP4 experts with their biases, both pinned, streamed: what the resident kernel computes;
    biases in pageable memory keep the stack off the streamed path."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from moedesk.kernels import gpu_quant
    from tests.kernels.test_gpu_quant_kernel import Q8_TOLERANCE, assert_close, gpt_oss_function, random_experts

    w = gpt_oss_function(random_experts(8, 2880, 2880, "mxfp4", seed=6), limit=1.0, dtype=torch.bfloat16, seed=7)
    assert not gpu_zero_copy.applies(torch.device("cuda"), w.pin_memory().with_function(w.gate_up_bias, w.down_bias,
                                                                                       w.glu))
    host = w.pin_memory()
    assert gpu_zero_copy.applies(torch.device("cuda"), host)
    x = torch.randn(1, 2880, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    ids = torch.tensor([[6, 1, 3, 7]], device="cuda")
    out = torch.zeros(4, 2880, dtype=torch.bfloat16, device="cuda")
    gpu_zero_copy.zero_copy_experts(x, ids, 1, host, out)
    assert (out[0] == 0).all()
    resident = host.to("cuda")
    # Where the resident kernel rounds x to 8 bits (mxfp4's integer route) and the streamed one does not: that
    # route's bound (tests/kernels/test_gpu_quant_kernel.py's Q8_TOLERANCE).
    bound = Q8_TOLERANCE if gpu_quant.takes_q8(x, resident.gate_up, "mxfp4", 1, 1) else (2 ** -7, 2 ** -8, 2 ** -7)
    for r in range(1, 4):
        expected = gpu_quant.expert_forward(x, resident.expert(int(ids[0, r])))
        assert_close(out[r:r + 1].float(), expected.double(), *bound, what=f"rank {r}: ")
