"""Profiler measurements that need the GPU box."""
import math

import pytest
import torch

from engine.profiler import contention


@pytest.mark.gpu
def test_contention_measures_both_sides_while_they_overlap():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    factors = contention(torch.device("cuda"), megabytes=128)
    assert set(factors) == {"cpu_slowdown_during_copy", "copy_slowdown_during_cpu"}
    # Reading host memory on both sides can only slow each down, within reason; noise can put a factor
    # a little below 1 (the latency model clips it to 1), never far.
    assert all(math.isfinite(v) and 0.5 < v < 6 for v in factors.values()), factors


@pytest.mark.gpu
def test_copy_launch_time_is_host_time_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.profiler import copy_launch_ms

    staging = torch.empty(2 * 1024, 2048, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(2048, 1024, dtype=torch.bfloat16, device="cuda")
    ms = copy_launch_ms(staging, staging, down, torch.device("cuda"))
    # A few dozen API calls: well above zero, far below the copy itself (8 MiB at PCIe speed is ~0.2 ms
    # only when it is not waited for; a launch that waited would take about that).
    assert 0.005 < ms < 2.0


@pytest.mark.gpu
def test_resident_launch_time_is_host_time_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.profiler import resident_launch_ms

    gate_up = torch.randn(2 * 768, 2048).to(torch.bfloat16)
    down = torch.randn(2048, 768).to(torch.bfloat16)
    ms = resident_launch_ms(gate_up, down, torch.device("cuda"))
    assert 0.005 < ms < 5.0  # a handful of launches and a small copy, never the experts' GPU time waited for


@pytest.mark.gpu
def test_streamed_expert_time_is_the_pcie_read():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.profiler import streamed_expert_ms

    gate_up = torch.randn(2 * 768, 2048).to(torch.bfloat16).pin_memory()
    down = torch.randn(2048, 768).to(torch.bfloat16).pin_memory()
    ms = streamed_expert_ms(gate_up, down, torch.device("cuda"))
    nbytes = (gate_up.numel() + down.numel()) * 2
    # Read over PCIe (under ~64 GB/s on a Gen5 x16 link), not from the L2 cache the last try filled, and
    # not stretched by the host's launches (over 5 GB/s).
    assert nbytes / 64e6 < ms < nbytes / 5e6
