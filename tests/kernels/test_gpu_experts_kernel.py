"""kernels.gpu_experts: the grouped launch computes what one GEMM per expert does."""
import pytest
import torch

from moedesk.kernels import gpu_experts
from moedesk.kernels.cpu_experts import expert_forward


def stacks(groups, hidden, width, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(groups, 2 * width, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    down = (torch.randn(groups, hidden, width, generator=g) / width ** 0.5).to(dtype).to(device)
    return gate_up, down


def per_expert(x, gate_up, down, sizes):
    out, start = [], 0
    for g, n in enumerate(sizes):
        if n:
            out.append(expert_forward(x[start:start + n], gate_up[g], down[g]))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[1, 0, 3, 2], [0, 0, 5], [4]])
def test_grouped_equals_per_expert_on_cpu(dtype, sizes):
    gate_up, down = stacks(len(sizes), 64, 32, dtype, "cpu")
    x = torch.randn(sum(sizes), 64).to(dtype)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = gpu_experts.grouped_experts_forward(x, gate_up, down, ends)
    assert gpu_experts.grouped_supported(x, gate_up) == (gpu_experts._grouped_mm is not None)
    assert torch.equal(got, per_expert(x, gate_up, down, sizes))


def test_fallback_loop_when_grouped_is_unavailable(monkeypatch):
    monkeypatch.setattr(gpu_experts, "_grouped_mm", None)
    sizes = [2, 0, 1]
    gate_up, down = stacks(3, 16, 8, torch.float32, "cpu")
    x = torch.randn(3, 16)
    got = gpu_experts.grouped_experts_forward(x, gate_up, down, torch.tensor(sizes).cumsum(0).to(torch.int32))
    assert torch.equal(got, per_expert(x, gate_up, down, sizes))


@pytest.mark.gpu
def test_grouped_bf16_close_to_per_expert_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sizes = [1, 0, 2, 1, 0, 3, 1, 1]
    gate_up, down = stacks(len(sizes), 2048, 768, torch.bfloat16, "cuda")
    x = torch.randn(sum(sizes), 2048, device="cuda").to(torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    got = gpu_experts.grouped_experts_forward(x, gate_up, down, ends)
    ref = per_expert(x.float(), gate_up.float(), down.float(), sizes)
    assert gpu_experts.grouped_supported(x, gate_up) == (torch.cuda.get_device_capability() == (9, 0))
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2)
