"""kernels.gpu_grouped: the Triton grouped launch computes what one GEMM per expert does.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), in float32 and float16 (numpy
has no bf16): float32 differs from torch's per-expert products only in summation order, float16 also by
where an intermediate lands on either side of a rounding step. On the GPU both bf16 and float32 are checked
against the same per-expert path, with the Triton kernels forced where torch's own grouped GEMM would run.
"""
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from moedesk.kernels import gpu_experts, gpu_grouped  # noqa: E402
from tests.kernels.test_gpu_experts_kernel import gpt_oss_function, per_expert, per_expert_biased, stacks  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter is used only where there is no GPU")


def run(sizes, hidden, width, dtype, device, seed=0):
    gate_up, down = stacks(len(sizes), hidden, width, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(sizes), hidden, generator=g).to(dtype).to(device)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    got = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends)
    return got, per_expert(x, gate_up, down, sizes)


def assert_close(got, ref, rel):
    scale = ref.float().pow(2).mean().sqrt()
    err = (got.float() - ref.float()).abs().max()
    assert err <= rel * scale, f"max error {err:.3g} against an RMS of {scale:.3g}"


@interpreted
@pytest.mark.parametrize("sizes", [[1, 0, 3, 17], [0, 0, 33], [2, 5, 0, 1, 0]])
def test_float32_equals_per_expert(sizes):
    # hidden and width not multiples of the tiles (64): masked edges in k and in the output columns
    got, ref = run(sizes, 48, 40, torch.float32, "cpu")
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert_close(got, ref, 1e-5)


@interpreted
def test_a_launch_over_the_active_groups_alone_computes_the_same():
    """Programs for the groups with rows only (kernels.gpu_fused.group_pairs's list, -1 past its end): the same
    result as programs for every group."""
    sizes = [2, 0, 0, 3, 0]
    gate_up, down = stacks(len(sizes), 48, 40, torch.float32, "cpu", 5)
    x = torch.randn(sum(sizes), 48, generator=torch.Generator().manual_seed(6))
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    every = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends)
    listed = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends, active=torch.tensor([0, 3, -1, -1, -1],
                                                                                               dtype=torch.int32))
    assert torch.equal(listed, every)
    assert_close(every, per_expert(x, gate_up, down, sizes), 1e-5)

@interpreted
def test_float16_rounds_as_torch_does():
    got, ref = run([3, 1, 0, 18], 64, 72, torch.float16, "cpu")
    assert got.dtype == torch.float16
    assert_close(got, ref, 2 ** -8)


@interpreted
def test_tokens_split_over_programs(monkeypatch):
    # prefill's tiles: several programs walk one group's tokens, each taking every SPLIT-th tile
    monkeypatch.setattr(gpu_grouped, "_config",
                        lambda m, groups, interpreted: dict(BT=16, BR=32, BK=32, SPLIT=3, num_warps=1))
    got, ref = run([70, 0, 5, 40], 48, 40, torch.float32, "cpu")
    assert_close(got, ref, 1e-5)


@interpreted
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2 ** -8)])
def test_gpt_oss_function_rounds_as_torch_does(dtype, bound):
    # Biases and the clamped SwiGLU (a limit where many clip) in the Triton launch: the per-expert torch ops'
    # roundings, with hidden and width not multiples of the tiles and a group of one row.
    sizes = [1, 0, 3, 18]
    gate_up, down = stacks(len(sizes), 48, 40, dtype, "cpu")
    function = gpt_oss_function(len(sizes), 48, 40, dtype, "cpu")
    x = torch.randn(sum(sizes), 48, generator=torch.Generator().manual_seed(5)).to(dtype)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends, **function)
    assert got.dtype == dtype
    assert_close(got, per_expert_biased(x, gate_up, down, sizes, **function), bound)


def test_no_rows_or_no_groups_give_an_empty_result():
    gate_up, down = stacks(2, 16, 8, torch.float32, "cpu")
    empty = gpu_grouped.grouped_experts_forward(torch.zeros(0, 16), gate_up, down,
                                                torch.zeros(2, dtype=torch.int32))
    assert empty.shape == (0, 16)


def test_only_cuda_tensors_of_the_stacks_dtype_apply():
    x, gate_up = torch.zeros(2, 16), torch.zeros(2, 16, 16)
    assert not gpu_grouped.applies(x, gate_up)  # the engine never sends CPU work to the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[1, 0, 2, 1, 0, 3, 1, 1], [300, 0, 17, 129]])
def test_gpt_oss_function_close_to_per_expert_on_cuda(dtype, sizes):
    # The Triton launch itself (torch's grouped GEMM takes bf16 on sm90 in the engine) at gpt-oss-120b's shape.
    gate_up, down = stacks(len(sizes), 2880, 2880, dtype, "cuda")
    function = gpt_oss_function(len(sizes), 2880, 2880, dtype, "cuda", limit=1.0)
    x = torch.randn(sum(sizes), 2880, device="cuda").to(dtype)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    got = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends, **function)
    assert_close(got, per_expert_biased(x, gate_up, down, sizes, **function), 1e-4 if dtype == torch.float32 else 2 ** -5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[1, 0, 2, 1, 0, 3, 1, 1], [300, 0, 17, 129]])
def test_close_to_per_expert_on_cuda(dtype, sizes):
    got, ref = run(sizes, 576, 1536, dtype, "cuda")
    # float32: IEEE products, only the order of the sums differs; bf16: a rounding step here and there
    assert_close(got, ref, 1e-4 if dtype == torch.float32 else 2 ** -6)


@pytest.mark.gpu
def test_cuda_float32_is_grouped_without_the_host():
    gate_up, down = stacks(4, 64, 32, torch.float32, "cuda")
    x = torch.randn(5, 64, device="cuda")
    assert gpu_experts.grouped_supported(x, gate_up)
    ends = torch.tensor([2, 2, 4, 5], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    gpu_experts.grouped_experts_forward(x, gate_up, down, ends)  # compiled before capture
    with torch.cuda.graph(graph):
        y = gpu_experts.grouped_experts_forward(x, gate_up, down, ends)
    ends.copy_(torch.tensor([1, 3, 3, 5], dtype=torch.int32))  # a new routing, replayed without the host
    graph.replay()
    assert_close(y, per_expert(x, gate_up, down, [1, 2, 0, 2]), 1e-4)
