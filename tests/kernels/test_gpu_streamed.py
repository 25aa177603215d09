"""Experts computed on the GPU from pinned host stacks (kernels.gpu_streamed) compute expert_forward.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is
no GPU), in float32, which checks the indexing and the formulas; the GPU test reads real pinned memory in bf16.
"""
import os

import pytest
import torch

from kernels.cpu_experts import expert_forward

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from kernels import gpu_streamed  # noqa: E402


def _stacks(e, f, h, dtype, pinned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * f, h, generator=g) / h ** 0.5).to(dtype)
    down = (torch.randn(e, h, f, generator=g) / f ** 0.5).to(dtype)
    x = torch.randn(3, h, generator=g).to(dtype)
    if pinned:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    return x, gate_up, down


def _expected(x, ids, gate_up, down):
    k = ids.shape[1]
    rows = [expert_forward(x[t:t + 1], gate_up[ids[t, r]], down[ids[t, r]]) for t in range(len(x)) for r in range(k)]
    return torch.cat(rows)


@pytest.mark.parametrize("f,h,first_rank", [(40, 72, 2), (16, 32, 0), (24, 2100, 3)])  # partial blocks; H > 2048
def test_streamed_experts_interpreted(f, h, first_rank):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    x, gate_up, down = _stacks(6, f, h, torch.float32)
    ids = torch.tensor([[0, 2, 3, 5], [1, 2, 4, 5], [0, 1, 3, 4]])
    out = torch.full((12, h), 7.0)
    gpu_streamed.streamed_experts(x, ids, first_rank, gate_up, down, out)
    expected = _expected(x, ids, gate_up, down).view(3, 4, h)
    got = out.view(3, 4, h)
    torch.testing.assert_close(got[:, first_rank:], expected[:, first_rank:], rtol=1e-5, atol=1e-5)
    assert (got[:, :first_rank] == 7.0).all()  # the ranks below first_rank are the CPU's: untouched


def test_applies_only_to_a_cuda_input_and_pinned_stacks():
    x, gate_up, _ = _stacks(2, 8, 16, torch.float32)
    assert not gpu_streamed.applies(x.device, gate_up)


@pytest.mark.gpu
def test_streamed_experts_read_pinned_memory_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x, gate_up, down = _stacks(8, 768, 2048, torch.bfloat16, pinned=True)
    x = x.cuda()
    assert gpu_streamed.applies(x.device, gate_up)
    ids = torch.tensor([[0, 3, 6, 7], [1, 2, 3, 4], [2, 5, 6, 7]], device="cuda")
    out = torch.zeros(12, 2048, dtype=torch.bfloat16, device="cuda")
    gpu_streamed.streamed_experts(x, ids, 1, gate_up, down, out)
    expected = _expected(x, ids, gate_up.cuda(), down.cuda()).view(3, 4, -1)
    got = out.view(3, 4, -1)
    assert (got[:, 0] == 0).all()
    # float32 sums in another order than cuBLAS: a rounding step apart at most, rarely.
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=2 ** -6, atol=2 ** -8)
    assert (got[:, 1:] != expected[:, 1:]).float().mean() < 0.05
