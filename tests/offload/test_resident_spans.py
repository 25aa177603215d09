"""A prefill step's resident experts computed in spans of slots, one grouped call each, where that computes each
expert as its own call would (packed experts on the GPU: kernels.experts.grouped_alike); OffloadExecutor's
`_resident_spans`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moedesk.engine.offload import offload_executor as oe
from moedesk.engine.offload.offload_executor import OffloadExecutor, _slot_spans
from moedesk.kernels.expert_weights import ExpertWeights


def test_slot_spans_hold_at_most_the_limit_counting_the_empty_slots_between():
    assert _slot_spans([0, 1, 2, 3], 3) == [(0, 3), (3, 4)]
    assert _slot_spans([0, 2, 3, 7], 3) == [(0, 3), (3, 4), (7, 8)]  # slot 1 (no tokens) counts toward 0-2's span
    assert _slot_spans([5], 3) == [(5, 6)]
    assert _slot_spans([0, 1, 2], 1) == [(0, 1), (1, 2), (2, 3)]


def prefill_layers(device: str, stack: ExpertWeights, hidden: int, tokens: int = 512):
    """Four layers of `tokens` tokens, top-2 of 8 experts: 0-3 resident with 200-260 tokens each (slot 1's expert gets
    none in the second layer), 4 copied, 5 on the CPU; and every expert resident in the third."""
    banks = {layer: stack.pin_memory() if device == "cuda" else stack for layer in range(4)}
    on_gpu = [[e < 4 for e in range(8)], [e < 4 for e in range(8)], [True] * 8, [e < 4 for e in range(8)]]
    g = torch.Generator().manual_seed(2)

    def ids(experts, light):
        pairs = torch.tensor(experts)[torch.arange(2 * tokens - len(light)) % len(experts)]
        pairs = torch.cat([pairs.sort().values, torch.tensor(light, dtype=torch.int64)]).sort().values
        both = torch.stack([pairs[:tokens], pairs[tokens:]], dim=1)
        return both[torch.randperm(tokens, generator=g)].to(device)

    routing = [ids([0, 1, 2, 3, 4], [5] * 6), ids([0, 2, 3, 4], [5] * 4), ids(list(range(8)), []),
               ids([0, 1, 2, 3, 4], [5] * 6)]
    x = (torch.randn(tokens, hidden, generator=g) / 4).bfloat16().to(device)
    split = lambda loads: ([e for e in loads if loads[e] < 20], [e for e in loads if loads[e] >= 20])  # noqa: E731
    return banks, on_gpu, split, x, routing


def run(device, stack, hidden, monkeypatch, spans_on: bool):
    banks, on_gpu, split, x, routing = prefill_layers(device, stack, hidden)
    # Decided as for Mixtral's large experts, whose resident share is not one grouped launch at prefill loads.
    monkeypatch.setattr(oe, "resident_grouped", lambda sizes, *shape, **slots: max(sizes) <= oe.GROUPED_MAX_TOKENS)
    if not spans_on:
        monkeypatch.setattr(oe, "_resident_spans", lambda *a: None)
    calls, real = [], oe.grouped_experts_forward
    monkeypatch.setattr(oe, "grouped_experts_forward", lambda xs, w, ends: calls.append(w.num_experts) or
                        real(xs, w, ends))
    executor = OffloadExecutor(banks, on_gpu, device, split, overlap_copies=True,
                               copy_runs=lambda loads, copy: [len(copy)])
    with torch.inference_mode():
        out = [executor.expert_outputs(SimpleNamespace(layer=layer), x, ids).float().cpu()
               for layer, ids in enumerate(routing)]
    assert executor.stats.cpu_experts == 3 and executor.stats.copied_experts == 3
    monkeypatch.undo()
    return out, calls


def bf16_stack(hidden: int, width: int, experts: int = 8) -> ExpertWeights:
    """Random bf16 experts (seed 0), each projection scaled by one over the root of its input width."""
    g = torch.Generator().manual_seed(0)
    return ExpertWeights((torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5).bfloat16(),
                         (torch.randn(experts, hidden, width, generator=g) / width ** 0.5).bfloat16(), hidden, width)


def test_spans_of_resident_slots_give_each_expert_its_rows(monkeypatch):
    """On the simulated tier, with spans forced (the CPU's grouped and one-expert paths round differently, so
    within bf16's rounding): each span's rows and ends line up with its experts, beside the copy run's ends."""
    hidden, width = 64, 32
    stack = bf16_stack(hidden, width)
    alone, calls_alone = run("cpu", stack, hidden, monkeypatch, spans_on=False)
    monkeypatch.setattr(oe, "grouped_alike", lambda x, w, sizes: True)
    monkeypatch.setattr(oe, "copy_run_limit", lambda hidden, width: 3)
    spanned, calls = run("cpu", stack, hidden, monkeypatch, spans_on=True)
    assert calls_alone == [1, 1, 1]  # the copy runs alone; 512 tokens over 8 resident experts take one GEMM each
    # Layers 0, 1 and 3: slots 0-2 (in layer 1, slot 1 empty) and 3, then the copy run; layer 2: 0-2, 3-5, 6-7.
    assert calls == [3, 1, 1, 3, 1, 1, 3, 3, 2, 3, 1, 1]
    for a, b in zip(spanned, alone):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        assert not a.isnan().any()


def test_no_spans_where_the_predicate_says_the_calls_differ(monkeypatch):
    """On the CPU the grouped path is not the one-expert path (grouped_alike is False there): one call an expert."""
    hidden, width = 64, 32
    stack = bf16_stack(hidden, width)
    _, calls = run("cpu", stack, hidden, monkeypatch, spans_on=True)
    assert calls == [1, 1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_k", "q4_0"])
def test_on_cuda_packed_resident_spans_equal_one_call_an_expert_bit_for_bit(monkeypatch, fmt):
    """Packed resident experts of 200-260 tokens each, in spans of up to 3 slots, give exactly what one call an
    expert gives (both take the dequant route: per-group bf16 weights, one grouped GEMM a projection)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.kernels import gpu_quant
    from tests.kernels.test_gpu_quant_kernel import random_experts

    hidden, width = 512, 256
    stack = random_experts(8, hidden, width, fmt)
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda")
    if not gpu_quant.groups_alike(x, stack.to("cuda"), [240, 240]):
        pytest.skip("no dequant route on this GPU (sm_90 and torch._grouped_mm)")
    alone, calls_alone = run("cuda", stack, hidden, monkeypatch, spans_on=False)
    monkeypatch.setattr(oe, "copy_run_limit", lambda hidden, width: 3)
    spanned, calls = run("cuda", stack, hidden, monkeypatch, spans_on=True)
    assert calls == [3, 1, 1, 3, 1, 1, 3, 3, 2, 3, 1, 1]
    for a, b in zip(spanned, alone):
        assert torch.equal(a, b)


def test_groups_are_alike_only_where_each_alone_and_all_together_take_the_dequant_route(monkeypatch):
    """kernels.gpu_quant.groups_alike, with the GPU's conditions granted: every non-empty group of at least 32 rows
    (the dequant route alone) and the span's rows at least 32 a group, its empty groups counted."""
    from moedesk.kernels import gpu_quant

    monkeypatch.setattr(gpu_quant, "applies", lambda x, w: True)
    monkeypatch.setattr(gpu_quant, "_dequant_route_works", lambda x: True)
    x = torch.zeros(1, 8)
    assert gpu_quant.groups_alike(x, None, [240, 0, 240])
    assert not gpu_quant.groups_alike(x, None, [240, 5])  # the 5 rows alone take the fused tiles
    assert not gpu_quant.groups_alike(x, None, [40, 0, 0])  # alone dequant; together 40 rows over 3 groups: fused
    assert not gpu_quant.groups_alike(x, None, [])
    monkeypatch.setattr(gpu_quant, "_dequant_route_works", lambda x: False)
    assert not gpu_quant.groups_alike(x, None, [240, 240])
