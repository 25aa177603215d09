"""A lone token's experts split by rows: the host computes each expert's first intermediate rows
(HostRouting.cpu_width), the GPU the rest from pinned RAM (OffloadExecutor.zero_copy_width), and their sum is the
expert. Here both halves run on the CPU (the GPU kernel under Triton's interpreter, as tests/conftest.py
sets it where there is no GPU); tests/model/test_gpu_equivalence.py runs the split inside the decode graphs."""
import os

import pytest
import torch

from moedesk.engine.offload.expert_executor import HostRouting
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.engine.offload.profiler import split_width_candidates
from moedesk.kernels.experts import reference_routed

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


def _bank(fmt: str | None):
    from tests.kernels.test_gpu_quant_kernel import random_experts
    from moedesk.kernels.expert_weights import ExpertWeights

    if fmt is not None:
        return random_experts(6, 256, 768, fmt, seed=4)
    g = torch.Generator().manual_seed(4)
    return ExpertWeights(torch.randn(6, 192, 64, generator=g) / 8, torch.randn(6, 64, 96, generator=g) / 10, 64, 96)


@pytest.mark.parametrize("fmt", [None, "q4_0", "q4_k"])
def test_host_rows_plus_zero_copy_rows_are_the_experts(fmt):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close

    bank = _bank(fmt)
    cpu_width = bank.width - split_width_candidates(bank)[-1]
    executor = OffloadExecutor({0: bank}, [[False] * 6], "cpu", lambda loads: ([], sorted(loads)))  # would copy all
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.randn(1, bank.hidden, generator=torch.Generator().manual_seed(1)), torch.tensor([[1, 4]])
    host_part = executor.expert_outputs(moe, x, ids, out=torch.zeros(2, bank.hidden),
                                        host=HostRouting(x, ids, None, cpu_width=cpu_width))
    gpu_part = torch.zeros(2, bank.hidden)
    executor.zero_copy_width(moe, x, ids, cpu_width, gpu_part)
    whole = reference_routed(x, ids.view(-1), 2, None, bank, torch.zeros(2, bank.hidden))
    # The packed CPU kernel rounds its inputs to int8 (tests/kernels/test_cpu_quant_kernel.py): ~1% off.
    assert_close(host_part + gpu_part, whole.double(), 5e-2 if fmt else 1e-4, 2e-2 if fmt else 1e-5)
    assert (host_part - whole).abs().max() > 1e-2 and (gpu_part - whole).abs().max() > 1e-2  # each half is partial
    stats = executor.stats
    assert (stats.cpu_experts, stats.split_experts, stats.copied_experts) == (2, 2, 0)  # the rows split, none copied


def test_the_simulated_tier_never_splits():
    executor = OffloadExecutor({0: _bank(None)}, [[False] * 6], "cpu", lambda loads: (sorted(loads), []),
                               zero_copy_ranks=lambda k: 0, split_width=lambda k: 32)
    assert executor.width_split(0, 1, 2) == 0


def test_the_executor_says_it_splits_lone_tokens_only_where_the_gpu_can_read_its_stacks():
    # What the placement prices a layer with nothing resident at (placement.LayerCosts.lone_split_saving_ms).
    split = dict(zero_copy_ranks=lambda k: 1, split_width=lambda k: 0)
    on_cpu = OffloadExecutor({0: _bank(None)}, [[False] * 6], "cpu", lambda loads: (sorted(loads), []), **split)
    assert not on_cpu.splits_lone_tokens  # no GPU to read them


@pytest.mark.gpu
def test_on_the_gpu_the_executor_splits_lone_tokens_where_its_policy_and_pinned_stacks_allow():
    split = dict(zero_copy_ranks=lambda k: 1, split_width=lambda k: 0)
    pinned = _bank("q4_k").pin_memory()
    assert OffloadExecutor({0: pinned}, [[False] * 6], "cuda", lambda loads: (sorted(loads), []),
                           **split).splits_lone_tokens
    assert not OffloadExecutor({0: pinned}, [[False] * 6], "cuda", lambda loads: (sorted(loads), [])).splits_lone_tokens
    assert not OffloadExecutor({0: _bank("q4_k")}, [[False] * 6], "cuda", lambda loads: (sorted(loads), []),
                               **split).splits_lone_tokens  # pageable stacks: the GPU cannot read them in place


def test_split_candidates_leave_the_cpu_whole_granules():
    from types import SimpleNamespace

    mixtral_q4_0 = SimpleNamespace(width=14336, packed=True, down_format="q4_0")
    assert split_width_candidates(mixtral_q4_0) == [896 * i for i in range(1, 9)]  # sixteenths up to half
    qwen3_q4_k = SimpleNamespace(width=768, packed=True, down_format="q6_k")  # 256-weight blocks: 3 per row
    assert split_width_candidates(qwen3_q4_k) == [256]
    assert split_width_candidates(SimpleNamespace(width=48, packed=False)) == [16]  # the CPU keeps 32 rows
