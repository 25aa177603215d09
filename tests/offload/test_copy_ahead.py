"""Experts of the next MoE layer copied during this one into the staging slots its own copies leave
(OffloadExecutor.copy_ahead_with, ExpertOrchestra.copy_ahead, MOEDESK_COPY_AHEAD): the same outputs as without, on the
simulated tier, whatever the plan copies; and the plan the orchestra runs is the one engine.offload.prefill_outlook
prices."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from moedesk.engine.offload import orchestration
from moedesk.engine.offload.assignment import GROUPED_COPIES_MIN_LOAD
from moedesk.engine.offload.offload_executor import OffloadExecutor, StepStats, stack_experts
from moedesk.engine.offload.prefill_outlook import expected_loads, prefetch_ahead, prefill_step
from moedesk.engine.runtime import Engine
from moedesk.kernels.expert_weights import ExpertWeights


@pytest.fixture
def moe8(tiny_checkpoint):
    """Eight experts a layer (the tiny Mixtral has four)."""
    engine = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")
    return engine, stack_experts(engine.model, pinned=False)


def copy_all(loads):
    return [], sorted(loads)


def warmed(executor, banks, hidden: int):
    """The executor after one step of the first two layers (its layer time measured once: `_layer_ms`), counts reset."""
    two_layers(executor, banks, hidden, seed=99)
    executor.stats = StepStats()
    return executor


def two_layers(executor, banks, hidden: int, tokens: int = 24, seed: int = 0, first=range(8), second=range(8)):
    """The first two MoE layers' expert outputs of one step, each on random tokens routed to two experts a token, of
    `first` in the first layer and of `second` in the second."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for layer, allowed in zip(sorted(banks)[:2], (first, second)):
        x = torch.randn(tokens, hidden, generator=g)
        allowed = torch.tensor(list(allowed))
        ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:2]] for _ in range(tokens)])
        outs.append(executor.expert_outputs(SimpleNamespace(layer=layer), x, ids).clone())
    return outs


def test_experts_copied_ahead_give_the_same_bytes_even_one_that_gets_no_token(moe8):
    """Bit for bit on the simulated tier, where a span of slots copied ahead is computed expert by expert as copies
    one by one are."""
    engine, banks = moe8
    hidden = engine.config.hidden_size
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    # The first layer copies its five routed experts into slots 0-4, leaving three; the second routes none to 5.
    route = dict(first=range(5), second=[0, 1, 2, 3, 4, 6, 7])
    plain = OffloadExecutor(banks, nothing, "cpu", copy_all)
    reference = two_layers(plain, banks, hidden, **route)
    executor = OffloadExecutor(banks, nothing, "cpu", copy_all)
    first, second = sorted(banks)[:2]
    asked = []

    def plan(layer, tokens, slots, layer_ms, own):
        asked.append((layer, tokens, slots, own))
        return [5, 1, 3, 0] if layer == second else []  # more than fit; the third layer's none

    executor.copy_ahead_with(plan)
    warmed(executor, banks, hidden)
    asked.clear()
    got = two_layers(executor, banks, hidden, **route)
    for a, b in zip(got, reference):
        assert torch.equal(a, b)  # a copied-ahead expert is computed as a copied one: the same arithmetic
    staging = executor.staging
    assert len(staging) == banks[second].num_experts  # no slot beyond the staging there was
    assert asked[0] == (second, 24, len(staging) - 5, 5)
    s = executor.stats
    assert s.ahead_copied == 3 and s.ahead_used == 2  # the plan's first three, 5 among them, which got no token
    assert s.copied_experts == plain.stats.copied_experts  # each routed expert once, copied in its layer or ahead


def test_an_expert_copied_ahead_that_gets_no_token_costs_nothing_but_its_copy(moe8):
    engine, banks = moe8
    hidden = engine.config.hidden_size
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    route = dict(first=range(4), second=[0, 1, 2, 3, 4, 6, 7])
    reference = two_layers(OffloadExecutor(banks, nothing, "cpu", copy_all), banks, hidden, **route)
    executor = OffloadExecutor(banks, nothing, "cpu", copy_all)
    second = sorted(banks)[1]
    executor.copy_ahead_with(lambda layer, tokens, slots, layer_ms, own: [5, 6] if layer == second else [])
    warmed(executor, banks, hidden)
    for a, b in zip(two_layers(executor, banks, hidden, **route), reference):
        assert torch.equal(a, b)
    assert (executor.stats.ahead_copied, executor.stats.ahead_used) == (2, 1)  # 5 routed no token
    # 5 and 6 in the last two slots, the bytes of the second layer's experts
    for slot, e in ((6, 5), (7, 6)):
        assert torch.equal(executor.staging[slot].gate_up[0], banks[second].gate_up[e])
        assert torch.equal(executor.staging[slot].down[0], banks[second].down[e])


def test_the_cpus_split_sees_only_the_experts_not_copied_ahead(moe8):
    engine, banks = moe8
    hidden = engine.config.hidden_size
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    seen = []

    def half(loads):
        seen.append(sorted(loads))
        return sorted(loads)[::2], sorted(loads)[1::2]

    reference = two_layers(OffloadExecutor(banks, nothing, "cpu", lambda loads: (sorted(loads), [])), banks, hidden)
    executor = OffloadExecutor(banks, nothing, "cpu", half)
    executor.copy_ahead_with(lambda layer, tokens, slots, layer_ms, own: [0, 2])
    warmed(executor, banks, hidden)
    seen.clear()
    got = two_layers(executor, banks, hidden)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the CPU's kernel is not the GPU's arithmetic
    assert 0 not in seen[1] and 2 not in seen[1] and 0 in seen[0]
    assert executor.stats.ahead_used == 2


def test_a_wholly_resident_next_layer_gets_no_copies_and_a_full_staging_none(moe8):
    engine, banks = moe8
    hidden = engine.config.hidden_size
    first, second = sorted(banks)[:2]
    on_gpu = [[layer == second] * bank.num_experts for layer, bank in sorted(banks.items())]
    reference = two_layers(OffloadExecutor(banks, on_gpu, "cpu", copy_all), banks, hidden, first=range(4))
    executor = OffloadExecutor(banks, on_gpu, "cpu", copy_all)
    executor.copy_ahead_with(lambda layer, tokens, slots, layer_ms, own: list(range(8)))
    warmed(executor, banks, hidden)
    for a, b in zip(two_layers(executor, banks, hidden, first=range(4)), reference):
        assert torch.equal(a, b)
    assert executor.stats.ahead_copied == 0  # every expert of the second layer is on the GPU already
    # A first layer whose own copies take every staging slot leaves none to copy ahead into.
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    executor = OffloadExecutor(banks, nothing, "cpu", copy_all)
    asked = []
    executor.copy_ahead_with(lambda layer, tokens, slots, layer_ms, own: asked.append(layer) or list(range(8)))
    warmed(executor, banks, hidden)
    asked.clear()
    executor.expert_outputs(SimpleNamespace(layer=first), torch.randn(8, hidden), torch.arange(16).view(8, 2) % 8)
    assert executor.stats.ahead_copied == 0 and asked == []
    # Step after step, as many as the free slots, in the same staging.
    stack = executor.staging_stack.gate_up
    for seed in range(3):
        two_layers(executor, banks, hidden, seed=seed, first=range(4), second=range(6))
    assert executor.staging_stack.gate_up is stack
    # Each step: 4 ahead for the second layer (8 slots, 4 own copies), all routed there (it routes 0-5); then 6 for
    # the third (of the second's 6 experts, 4 came ahead: 2 own copies), dropped by the next step's first layer.
    assert executor.stats.ahead_copied == 3 * (4 + 6)
    assert executor.stats.ahead_used == 3 * 4


def test_copies_made_for_a_layer_that_does_not_run_next_are_dropped(moe8):
    engine, banks = moe8
    hidden = engine.config.hidden_size
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    first = min(banks)
    executor = OffloadExecutor(banks, nothing, "cpu", lambda loads: (sorted(loads), []))
    executor.copy_ahead_with(lambda layer, tokens, slots, layer_ms, own: [0, 1])
    warmed(executor, banks, hidden)
    x = torch.randn(8, hidden)
    ids = torch.tensor([[0, 1]] * 8)
    moe = SimpleNamespace(layer=first)
    once = executor.expert_outputs(moe, x, ids).clone()
    again = executor.expert_outputs(moe, x, ids)  # a new step: the copies were for the second layer
    assert torch.equal(once, again)
    assert executor.stats.ahead_used == 0 and executor.stats.cpu_experts == 4


def test_a_prefill_with_copies_ahead_keeps_the_reference_tokens(tiny_checkpoint):
    from tests.offload.test_copy_runs import greedy_offloaded

    ahead = lambda executor: executor.copy_ahead_with(  # noqa: E731
        lambda layer, tokens, slots, layer_ms, own: list(range(0, 8, 2)))
    engine, tokens, expected = greedy_offloaded(tiny_checkpoint, 8, {}, ahead)
    assert tokens == expected
    assert engine.executor.stats.ahead_used > 0


def test_the_plan_is_the_outlooks_expected_loads_on_prefill_steps_only():
    share = [4.0, 0.0, 2.0, 2.0]
    offloaded = [True, True, True, False]
    assert expected_loads(share, offloaded, tokens=10, top_k=2) == {0: 10.0, 1: 0.0, 2: 5.0}
    least = int(GROUPED_COPIES_MIN_LOAD * 8 / 2)  # the fewest tokens of a prefill step, 8 experts of which 2 a token
    assert prefill_step(512, 2, 8) and not prefill_step(1, 2, 8) and not prefill_step(least - 1, 2, 8)
    assert prefill_step(least, 2, 8)
    costs = SimpleNamespace(copy_expert_ms=1.0, cpu_expert_ms=lambda n: 0.1 * n, activation_roundtrip_ms=lambda n: 0.0)
    picked = prefetch_ahead(expected_loads(share, offloaded, 10, 2), costs, float("inf"), slots=1)
    assert picked == [0]  # the dearest on the CPU at its expected load; never 1 (no token expected)
    assert prefetch_ahead(expected_loads(share, offloaded, 10, 2), costs, float("inf"), slots=5) == [0, 2]


def test_the_switch_turns_the_orchestras_plan_on_and_it_reads_the_popularity(tmp_path, monkeypatch):
    from moedesk.engine.offload.orchestration import ExpertOrchestra

    hidden, width = 64, 32
    g = torch.Generator().manual_seed(0)
    banks = {layer: ExpertWeights(torch.randn(8, 2 * width, hidden, generator=g),
                                  torch.randn(8, hidden, width, generator=g), hidden, width) for layer in (0, 2)}
    for value, on in (("", False), ("0", False), ("no", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("MOEDESK_COPY_AHEAD", value)
        assert orchestration.copy_ahead_wanted() is on
    monkeypatch.delenv("MOEDESK_COPY_AHEAD", raising=False)
    off = ExpertOrchestra.start(banks, torch.device("cpu"), ("test", (hidden, width)), tmp_path, top_k=2)
    assert off.executor.copy_ahead is None
    monkeypatch.setenv("MOEDESK_COPY_AHEAD", "0")
    assert ExpertOrchestra.start(banks, torch.device("cpu"), ("test", (hidden, width)), tmp_path,
                                 top_k=2).executor.copy_ahead is None
    monkeypatch.setenv("MOEDESK_COPY_AHEAD", "1")
    orchestra = ExpertOrchestra.start(banks, torch.device("cpu"), ("test", (hidden, width)), tmp_path, top_k=2)
    orchestra.costs = replace(orchestra.costs, copy_expert_ms=1.0)  # the plan reads the costs when asked
    executor = orchestra.executor
    orchestra.popularity = [[1.0] * 8, [0, 0, 0, 1, 0, 4, 0, 9]]
    executor.set_placement([[False] * 8, [e == 7 for e in range(8)]])
    plan = executor.copy_ahead
    # Expert 7 is resident and those of no popularity expect no token: 3 and 5 are left, in the order of their CPU
    # time as this machine's profile prices it (prefetch_ahead); one slot takes one; a decode step's token none.
    first = plan(2, 512, 2, 100.0, 0)
    assert sorted(first) == [3, 5] and plan(2, 512, 1, 100.0, 0) == first[:1] and plan(2, 1, 2, 100.0, 0) == []
    # The link's free time: the layer's 2.5 ms less its own copies (1 ms each) holds two, one, none.
    assert [len(plan(2, 512, 8, 2.5, own)) for own in (0, 1, 2)] == [2, 1, 0]
    twin = orchestra.twin()  # nothing resident there: expert 7 is planned too, from the twin's own placement
    assert sorted(twin.executor.copy_ahead(2, 512, 3, 100.0, 0)) == [3, 5, 7]
    orchestra.copy_ahead(False)
    assert executor.copy_ahead is None and orchestra.twin().executor.copy_ahead is None


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [False, True])
def test_on_the_gpu_copies_ahead_land_before_their_compute_and_are_not_overwritten(runs):
    """CUDA, copy stream and events: step after step of three layers, each copying three experts of the next ahead
    into the slots its own copies leave while the next layer's own copies (one by one or in runs) reuse the slots
    the ahead copies' compute read; outputs those of the same executor without copies ahead (a copied-ahead span is
    one grouped launch, where the reference computes each copied expert on its own or in its own runs: within bf16's
    rounding; an overwritten slot would be another expert, far off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, width, experts, tokens = 256, 128, 8, 64
    g = torch.Generator().manual_seed(3)
    banks = {layer: ExpertWeights(torch.randn(experts, 2 * width, hidden, generator=g).bfloat16() / 16,
                                  torch.randn(experts, hidden, width, generator=g).bfloat16() / 16, hidden,
                                  width).pin_memory() for layer in range(3)}
    nothing = [[False] * experts for _ in banks]
    copy_runs = (lambda loads, copy: [len(copy)]) if runs else None
    made = [OffloadExecutor(banks, nothing, "cuda", copy_all, copy_runs=copy_runs) for _ in range(2)]
    made[1].copy_ahead_with(lambda layer, n, slots, layer_ms, own: [7, 6, 5, 0])
    steps = []
    for seed in range(4):
        g.manual_seed(seed)
        steps.append([(torch.randn(tokens, hidden, generator=g).bfloat16().cuda(),
                       torch.stack([torch.randperm(experts if layer else 5, generator=g)[:2]
                                    for _ in range(tokens)]).cuda()) for layer in range(3)])
    outs = [[], []]
    for i, executor in enumerate(made):
        for step in steps:
            for layer, (x, ids) in enumerate(step):
                outs[i].append(executor.expert_outputs(SimpleNamespace(layer=layer), x, ids).float().cpu())
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert made[1].stats.ahead_used > 0
