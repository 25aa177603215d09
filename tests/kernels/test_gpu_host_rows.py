"""Rows of a table in pinned host memory gathered onto the GPU (kernels.gpu_host_rows) equal the table's rows.

On the CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU);
the GPU test reads real pinned memory, inside a CUDA graph as decode replays it."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from moedesk.kernels import gpu_host_rows  # noqa: E402


@pytest.mark.parametrize("hidden", [72, 2100])  # a partial block; more than one block a row
def test_host_rows_interpreted(hidden):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    table = torch.randn(50, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.tensor([[3, 49, 3], [0, 17, 48]])
    got = gpu_host_rows.host_rows(table, ids)
    assert got.shape == (2, 3, hidden)
    assert torch.equal(got, F.embedding(ids, table))


def test_applies_only_on_a_gpu():
    assert not gpu_host_rows.applies("cpu")


@pytest.mark.gpu
def test_host_rows_read_pinned_memory_inside_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    table = torch.randn(1000, 2880, dtype=torch.bfloat16).pin_memory()  # gpt-oss's width
    ids = torch.tensor([[5, 999, 5, 0]], device="cuda")
    gpu_host_rows.host_rows(table, ids)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu_host_rows.host_rows(table, ids)
    ids.copy_(torch.tensor([[1, 2, 998, 7]]))
    graph.replay()
    torch.cuda.synchronize()
    assert out.is_cuda
    assert torch.equal(out.cpu(), F.embedding(ids.cpu(), table))
