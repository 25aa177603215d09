"""Profiler measurements that need the GPU box."""
import math

import pytest
import torch

from moedesk.engine.offload.profiler import contention
from moedesk.kernels.expert_weights import ExpertWeights


def pinned_bf16_experts(count: int, hidden: int, width: int) -> ExpertWeights:
    """Random bf16 experts in pinned host memory, as the profiler's copies read them."""
    return ExpertWeights(torch.randn(count, 2 * width, hidden).to(torch.bfloat16).pin_memory(),
                         torch.randn(count, hidden, width).to(torch.bfloat16).pin_memory(), hidden=hidden, width=width)


@pytest.mark.gpu
def test_contention_measures_both_sides_while_they_overlap():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # Four pinned bf16 experts of 24 MiB: the calls take them in turn, two at a time (megabytes=40).
    hidden, width = 2048, 2048
    w = pinned_bf16_experts(4, hidden, width)
    factors = contention(w, torch.device("cuda"), tokens=(1, 8), megabytes=40)
    assert set(factors) == {"cpu_slowdown_during_copy", "copy_slowdown_during_cpu"}
    # Reading host memory on both sides can only slow each down, within reason; noise can put a factor
    # a little below 1 (the latency model clips it to 1), never far.
    for by_tokens in factors.values():
        assert set(by_tokens) == {1, 8}
        assert all(math.isfinite(v) and 0.5 < v < 6 for v in by_tokens.values()), factors
    assert contention(ExpertWeights(w.gate_up.clone(), w.down.clone(), hidden, width), torch.device("cuda")) == {}


@pytest.mark.gpu
def test_copy_launch_time_is_host_time_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.engine.offload.profiler import copy_launch_ms

    staging = ExpertWeights.empty(1, 2048, 1024, dtype=torch.bfloat16, device="cuda")
    ms = copy_launch_ms(staging, torch.bfloat16, torch.device("cuda"))
    # A few dozen API calls: well above zero, far below the copy itself (8 MiB at PCIe speed is ~0.2 ms
    # only when it is not waited for; a launch that waited would take about that).
    assert 0.005 < ms < 2.0


@pytest.mark.gpu
def test_copies_queued_back_to_back_are_timed_per_copy_at_each_load():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.engine.offload.latency_model import fit_latency_model
    from moedesk.engine.offload.profiler import copy_launch_prefill_ms

    hidden, width = 2048, 1024
    w = pinned_bf16_experts(8, hidden, width)
    points = copy_launch_prefill_ms(w, torch.bfloat16, torch.device("cuda"), tokens=(16, 64), copies=4)
    launches = points["copy_launch_prefill_ms"]
    # Host time per copy: API calls, never the 12 MiB copy waited for (~0.25 ms a copy at PCIe speed, 4 of them).
    assert set(launches) == {16, 64} and all(0.005 < ms < 2.0 for ms in launches.values()), launches
    model = fit_latency_model({"cpu_expert_ms": {1: 1.0}, "gpu_expert_ms": {1: 0.1}, "copy_expert_ms": 0.25,
                               **points})
    assert model.copy_launch_at(16) == pytest.approx(launches[16])


@pytest.mark.gpu
def test_resident_launch_time_is_host_time_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.engine.offload.profiler import resident_launch_ms

    expert = ExpertWeights(torch.randn(1, 2 * 768, 2048).to(torch.bfloat16), torch.randn(1, 2048, 768).to(torch.bfloat16),
                           hidden=2048, width=768)
    ms = resident_launch_ms(expert, torch.bfloat16, torch.device("cuda"))
    assert 0.005 < ms < 5.0  # a handful of launches and a small copy, never the experts' GPU time waited for


@pytest.mark.gpu
def test_zero_copy_split_is_measured_from_ram():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.engine.offload.profiler import profile_zero_copy, split_width_candidates

    stacks = pinned_bf16_experts(8, 2048, 768)
    points = profile_zero_copy(stacks, 8, torch.device("cuda"))
    split = points["zero_copy_split_ms"]
    assert points["zero_copy_top_k"] == 8 and sorted(split) == [0, 1, 2, 3, 4]
    expert_bytes = 3 * 768 * 2048 * 2
    for g, ms in split.items():
        # The GPU's share crosses PCIe (under ~64 GB/s on Gen5 x16): not served from a cache the last try filled.
        assert g * expert_bytes / 64e6 < ms < 100
    rows = points["split_width_ms"]
    assert sorted(rows) == split_width_candidates(stacks) == [32, 96, 128, 192, 224, 288, 320, 384]  # to half
    for r, ms in rows.items():  # the GPU reads r rows of each of the 8 experts over PCIe
        assert 8 * r / 768 * expert_bytes / 64e6 < ms < 100
    assert profile_zero_copy(stacks, 8, torch.device("cpu")) == {}  # nothing to stream to
