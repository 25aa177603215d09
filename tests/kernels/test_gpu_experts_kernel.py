"""kernels.gpu_experts: the grouped launch computes what one GEMM per expert does."""
import pytest
import torch

from moedesk.kernels import gpu_experts
from moedesk.kernels.cpu_experts import expert_forward
from moedesk.kernels.expert_weights import ClampedSwiGLU
from tests.kernels.gpt_oss_reference import gpt_oss_experts


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


def gpt_oss_function(groups, hidden, width, dtype, device, limit=0.75, seed=0):
    """Biases about half the projections' outputs and gpt-oss's clamped SwiGLU at a limit where many clip."""
    g = torch.Generator().manual_seed(seed + 7)
    return dict(gate_up_bias=(torch.randn(groups, 2 * width, generator=g) * 0.5).to(dtype).to(device),
                down_bias=(torch.randn(groups, hidden, generator=g) * 0.5).to(dtype).to(device),
                glu=ClampedSwiGLU(1.702, limit))


def per_expert_biased(x, gate_up, down, sizes, gate_up_bias, down_bias, glu):
    out, start = [], 0
    for g, n in enumerate(sizes):
        if n:
            out.append(gpu_experts.biased_expert_forward(x[start:start + n], gate_up[g], down[g], gate_up_bias[g],
                                                         down_bias[g], glu))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "per-expert-loop"])
def test_gpt_oss_experts_grouped_equal_per_expert_and_transformers(dtype, grouped, monkeypatch):
    # gpt-oss's biases and clamped SwiGLU through torch's grouped GEMM (and the loop without it): the per-expert
    # torch ops' bits, and in float32 transformers' GptOssExperts up to summation order.
    if not grouped:
        monkeypatch.setattr(gpu_experts, "_grouped_mm", None)
    sizes = [1, 0, 3, 2, 9]
    gate_up, down = stacks(len(sizes), 64, 32, dtype, "cpu")
    function = gpt_oss_function(len(sizes), 64, 32, dtype, "cpu")
    x = torch.randn(sum(sizes), 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = gpu_experts.grouped_experts_forward(x, gate_up, down, ends, **function)
    expected = per_expert_biased(x, gate_up, down, sizes, **function)
    assert torch.equal(got, expected)
    theirs = gpt_oss_experts(x, gate_up, down, *function.values(), sizes, dtype=dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    else:  # bf16: the same roundings, products summed in another order
        assert (got.float() - theirs.float()).abs().max() <= 2 ** -6 * theirs.float().abs().max()
    plain = gpu_experts.grouped_experts_forward(x, gate_up, down, ends)
    assert not torch.allclose(plain.float(), got.float(), atol=0.1), "the function must change the result"


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


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[1, 0, 2, 1, 0, 3, 1, 1], [300, 0, 17, 129]], ids=["decode", "prefill"])
def test_gpt_oss_experts_bf16_on_cuda(sizes):
    # gpt-oss-120b's expert shape in bf16 with its function, through whichever grouped path this GPU takes (torch's
    # on sm90, Triton's elsewhere): the per-expert torch ops within a few bf16 steps.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gate_up, down = stacks(len(sizes), 2880, 2880, torch.bfloat16, "cuda")
    function = gpt_oss_function(len(sizes), 2880, 2880, torch.bfloat16, "cuda", limit=1.0)
    x = torch.randn(sum(sizes), 2880, device="cuda").to(torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    got = gpu_experts.grouped_experts_forward(x, gate_up, down, ends, **function)
    expected = per_expert_biased(x, gate_up, down, sizes, **function)
    err = (got.float() - expected.float()).abs().max().item()
    scale = expected.float().pow(2).mean().sqrt().item()
    assert err <= 2 ** -5 * scale, f"sizes {sizes}: max error {err:.3g} against an RMS of {scale:.3g}"
