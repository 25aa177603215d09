"""A lone token's experts split by rows: the host computes each expert's first intermediate rows
(HostRouting.cpu_rows), the GPU the rest from pinned RAM (OffloadExecutor.stream_rows), and their sum is the
expert. Here both halves run on the CPU (the GPU kernel under Triton's interpreter, as tests/conftest.py
sets it where there is no GPU); tests/model/test_gpu_equivalence.py runs the split inside the decode graphs."""
import os

import pytest
import torch

from engine.offload.executor import HostRouting
from engine.offload.offload_executor import OffloadExecutor
from engine.offload.profiler import split_row_candidates
from kernels.experts import reference_routed

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


def _bank(fmt: str | None):
    from tests.kernels.test_gpu_quant_kernel import random_experts
    from kernels.expert_weights import ExpertWeights

    if fmt is not None:
        return random_experts(6, 256, 768, fmt, seed=4)
    g = torch.Generator().manual_seed(4)
    return ExpertWeights(torch.randn(6, 192, 64, generator=g) / 8, torch.randn(6, 64, 96, generator=g) / 10, 64, 96)


@pytest.mark.parametrize("fmt", [None, "q4_0", "q4_k"])
def test_host_rows_plus_streamed_rows_are_the_experts(fmt):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close

    bank = _bank(fmt)
    cpu_rows = bank.width - split_row_candidates(bank)[-1]
    executor = OffloadExecutor({0: bank}, [[False] * 6], "cpu", lambda loads: ([], sorted(loads)))  # would copy all
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.randn(1, bank.hidden, generator=torch.Generator().manual_seed(1)), torch.tensor([[1, 4]])
    host_part = executor.expert_outputs(moe, x, ids, out=torch.zeros(2, bank.hidden),
                                        host=HostRouting(x, ids, None, cpu_rows=cpu_rows))
    gpu_part = torch.zeros(2, bank.hidden)
    executor.stream_rows(moe, x, ids, cpu_rows, gpu_part)
    whole = reference_routed(x, ids.view(-1), 2, None, bank, torch.zeros(2, bank.hidden))
    # The packed CPU kernel rounds its inputs to int8 (tests/kernels/test_cpu_quant_kernel.py): ~1% off.
    assert_close(host_part + gpu_part, whole.double(), 5e-2 if fmt else 1e-4, 2e-2 if fmt else 1e-5)
    assert (host_part - whole).abs().max() > 1e-2 and (gpu_part - whole).abs().max() > 1e-2  # each half is partial
    stats = executor.stats
    assert (stats.cpu_experts, stats.split_experts, stats.copied_experts) == (2, 2, 0)  # the rows split, none copied


def test_the_simulated_tier_never_splits():
    executor = OffloadExecutor({0: _bank(None)}, [[False] * 6], "cpu", lambda loads: (sorted(loads), []),
                               streamed_ranks=lambda k: 0, split_rows=lambda k, tokens: 32)
    assert executor.row_split(0, 1, 2) == 0


def test_split_candidates_leave_the_cpu_whole_granules():
    from types import SimpleNamespace

    mixtral_q4_0 = SimpleNamespace(width=14336, packed=True, down_format="q4_0")
    assert split_row_candidates(mixtral_q4_0) == [896 * i for i in range(1, 9)]  # sixteenths up to half
    qwen3_q4_k = SimpleNamespace(width=768, packed=True, down_format="q6_k")  # 256-weight blocks: 3 per row
    assert split_row_candidates(qwen3_q4_k) == [256]
    assert split_row_candidates(SimpleNamespace(width=48, packed=False)) == [16]  # the CPU keeps 32 rows


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_several_tokens_host_rows_plus_streamed_rows_are_the_experts(fmt):
    """A batch's split (16 sequences decoding together): the host's first rows of every pair's expert plus the
    GPU's last rows, read once per expert for all of its tokens (kernels/gpu_streamed.py groups them), are each
    pair's whole expert."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    from tests.kernels.test_gpu_quant_kernel import assert_close

    bank = _bank(fmt)
    cpu_rows = bank.width - split_row_candidates(bank)[-1]
    executor = OffloadExecutor({0: bank}, [[False] * 6], "cpu", lambda loads: ([], sorted(loads)))
    moe = type("Moe", (), {"layer": 0})()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, bank.hidden, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])  # 14 pairs over 4 experts
    host_part = executor.expert_outputs(moe, x, ids, out=torch.zeros(14, bank.hidden),
                                        host=HostRouting(x, ids, None, cpu_rows=cpu_rows))
    gpu_part = torch.zeros(14, bank.hidden)
    executor.stream_rows(moe, x, ids, cpu_rows, gpu_part)
    whole = reference_routed(x, ids.view(-1), 2, None, bank, torch.zeros(14, bank.hidden))
    assert_close(host_part + gpu_part, whole.double(), 5e-2, 2e-2)
    assert (gpu_part - whole).abs().max() > 1e-2
    assert (executor.stats.split_experts, executor.stats.copied_experts) == (len(ids.unique()), 0)


def _costs(**kw):
    from engine.offload.latency_model import LatencyModel

    # One Mixtral q4_0 expert: 0.6 ms + 0.1 a token on the CPU; the lone token's layer 2.0 ms on the CPU alone,
    # 1.5 with the GPU taking each expert's last 4,480 rows.
    base = dict(cpu_intercept_ms=0.6, cpu_per_token_ms=0.1, cpu_floor_ms=0.5, gpu_tokens=(1.0,), gpu_ms=(0.2,),
                copy_expert_ms=1.8, streamed_split_ms=(2.0, 2.6), streamed_top_k=2, split_rows_ms=((4480, 1.5),))
    return LatencyModel(**{**base, **kw})


def test_a_batch_split_gives_the_gpu_more_rows_the_more_tokens_each_expert_has():
    from engine.offload.placement import split_rows, tokens_per_active_expert

    costs = _costs()
    assert split_rows(2, costs) == 4480 == split_rows(2, costs, 1, 8, 14336, 32)
    assert tokens_per_active_expert(16, 2, 8) == pytest.approx(32 / (8 * (1 - 0.75 ** 16)))  # ~4.04
    rows = [split_rows(2, costs, n, 8, 14336, 32) for n in (2, 4, 16, 64)]
    assert all(r % 32 == 0 for r in rows) and rows == sorted(rows) and rows[0] > 4480 and rows[-1] < 14336
    # 16 tokens: c = cpu(4.04) / cpu(1), the balance r = F c / (c + (F - r1) / r1)
    c = costs.cpu_expert_ms(tokens_per_active_expert(16, 2, 8)) / costs.cpu_expert_ms(1)
    assert abs(rows[2] - 14336 * c / (c + (14336 - 4480) / 4480)) <= 16
    # No lone-token split measured or worth it: none for a batch either; nor without the layer's shape.
    assert split_rows(2, _costs(split_rows_ms=((4480, 1.99),)), 16, 8, 14336, 32) == 0
    assert split_rows(2, costs, 16) == 0


def _device_executor(monkeypatch, bank, decide, split=lambda k, tokens: 4480 if tokens == 1 else 5120):
    """An executor that answers row_split as it would beside a GPU: the stacks taken as streamable."""
    from kernels import gpu_streamed

    monkeypatch.setattr(gpu_streamed, "applies", lambda device, w: True)
    executor = OffloadExecutor({0: bank}, [[False] * bank.num_experts], "cpu", decide,
                               streamed_ranks=lambda k: 0, split_rows=split)
    executor.simulated = False
    return executor


def test_a_batch_splits_only_packed_layers_the_cpu_would_compute_whole(monkeypatch):
    from tests.kernels.test_gpu_quant_kernel import random_experts

    packed = random_experts(8, 256, 14336 // 56, "q4_0", seed=1)  # 256 rows
    small = lambda k, tokens: 64 if tokens == 1 else 96  # noqa: E731
    cpu_all = _device_executor(monkeypatch, packed, lambda loads: (sorted(loads), []), small)
    assert cpu_all.row_split(0, 1, 2) == 256 - 64
    assert cpu_all.row_split(0, 16, 2) == 256 - 96
    # The per-step rule would copy experts at ~4 tokens each (as for prefill): the step is not split.
    copies = _device_executor(monkeypatch, packed, lambda loads: ([], sorted(loads)[:1]), small)
    assert copies.row_split(0, 16, 2) == 0
    # Dense stacks stream per pair (each token reading its experts' rows): a lone token only.
    dense = _device_executor(monkeypatch, _bank(None), lambda loads: (sorted(loads), []), lambda k, tokens: 32)
    assert dense.row_split(0, 1, 2) == 96 - 32 and dense.row_split(0, 16, 2) == 0
