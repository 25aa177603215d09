"""tests/perf/simulate_expert_cache.py's pieces: the step's price, the copies', the LRU and clairvoyant caches, the
replay, on hand-made numbers and small traces (no GPU)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moedesk.engine.offload.expert_cache import CachePolicy, ExpertCache, replay
from moedesk.engine.offload.routing_trace import CONVERSATION, TraceShape, step_counts, synthetic_trace
from tests.perf import simulate_expert_cache as sim

PRICES = sim.StepPrices(roundtrip_ms=0.1, call_ms=0.2, share_ms=0.01, resident_launch_ms=0.5, copy_ms=1.0,
                        copy_launch_ms=0.25, link_gbs=40.0, expert_bytes=1)


def test_a_step_costs_the_handoff_of_each_partly_resident_layer_and_its_misses():
    resident = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=bool)
    counts = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 0]])
    costly = replace(PRICES, share_ms=0.6)  # a hit's share above the launch: the GPU computes it
    # layer 0 whole: free; 1: round trip, call, one miss, a launch; 2: no hits, no launch; 3: like 1.
    expected = 3 * 0.1 + 3 * 0.2 + 4 * 0.6 + 2 * 0.5
    assert sim.moe_ms(resident, counts, costly) == pytest.approx(expected)
    # every selection of a partly resident layer a hit: the call and the shares go, the round trip stays
    all_hits = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert sim.moe_ms(resident, all_hits, costly) == pytest.approx(3 * 0.1 + 2 * 0.5)


def test_hits_cheaper_on_the_cpu_than_a_launch_join_the_cpu_call_and_save_nothing():
    resident = np.array([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=bool)
    counts = np.array([[1, 0, 1, 0], [1, 1, 0, 0]])
    # layer 0: its hit's share (0.01) is below the launch (0.5), so the CPU takes it; layer 1 has no CPU call to join
    expected = 2 * 0.1 + 0.2 + 2 * 0.01 + 0.5
    assert sim.moe_ms(resident, counts, PRICES) == pytest.approx(expected)
    assert sim.moe_ms(np.zeros_like(resident[:1]), counts[:1], PRICES) == pytest.approx(0.1 + 0.2 + 2 * 0.01)


def test_copies_stall_the_step_unless_the_link_moves_them_beside_it():
    assert sim.copies_ms(4, 10.0, PRICES, "stalled") == pytest.approx(4 * 1.25)
    assert sim.copies_ms(4, 10.0, PRICES, "overlapped") == pytest.approx(4 * 0.25)  # the link has time: launches only
    assert sim.copies_ms(4, 10.0, PRICES, "batched") == 0.0
    assert sim.copies_ms(14, 10.0, PRICES, "batched") == pytest.approx(4.0)  # what the step's time cannot hide


def test_lru_admits_the_misses_in_place_of_the_least_recently_used_within_its_budget():
    resident = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=bool)
    cache = sim.LruCache(resident, copies_per_step=1)
    cache.observe(np.array([[1, 0, 0, 0], [0, 0, 0, 0]]))  # expert 0 used: 1 is now the oldest resident
    assert cache.resident[0].tolist() == [True, True, False, False]
    swaps = cache.observe(np.array([[0, 0, 2, 1], [1, 1, 0, 0]]))
    assert [(s.layer, s.evict, s.admit) for s in swaps] == [(0, 1, 2)]  # the most used miss first; one a step
    assert cache.resident[0].tolist() == [True, False, True, False]
    assert cache.resident[1].all()  # a whole layer never changes
    assert (cache.hits, cache.selections, cache.swaps) == (3, 6, 1)


def test_lru_never_evicts_an_expert_the_step_used():
    cache = sim.LruCache(np.array([[1, 1, 0, 0]], dtype=bool))
    assert cache.observe(np.array([[1, 1, 1, 0]])) == []
    assert cache.resident[0].tolist() == [True, True, False, False]


def conversation(shape: TraceShape, steps: int) -> list[np.ndarray]:
    return [step_counts(s, shape.experts) for s in synthetic_trace(shape, steps, CONVERSATION, seed=3)]


def test_the_clairvoyant_bound_beats_lru_and_hits_everything_with_top_k_slots():
    shape = TraceShape(2, 32, 4)
    trace = conversation(shape, 120)
    few = np.zeros((2, 32), dtype=bool)
    few[:, :8] = True
    lru = sim.simulate(trace, sim.LruCache(few), PRICES, 0.0, warmup=0)
    bound = sim.simulate(trace, sim.Clairvoyant(few, trace), PRICES, 0.0, warmup=0)
    assert bound.hit_rate >= lru.hit_rate
    top_k = np.zeros((2, 32), dtype=bool)
    top_k[:, :4] = True
    assert sim.simulate(trace, sim.Clairvoyant(top_k, trace), PRICES, 0.0, warmup=1).hit_rate == 1.0


@pytest.mark.parametrize("policy", [None, CachePolicy()])
def test_simulate_replays_as_replay_does(policy):
    shape = TraceShape(3, 16, 2)
    trace = conversation(shape, 60)
    resident = np.zeros((3, 16), dtype=bool)
    resident[:, :5] = True
    expected = replay(trace, resident, policy)
    got = sim.simulate(trace, ExpertCache(resident, policy or CachePolicy(swaps_per_step=0)), PRICES, 2.0, warmup=0)
    assert got.hit_rate == pytest.approx(expected.hit_rate)
    # swaps decided after the last step are never paid for: the replay's count less those
    assert got.swaps_per_step * len(trace) <= expected.swaps
    assert got.step_ms["stalled"] >= got.step_ms["overlapped"] >= got.step_ms["batched"] >= 2.0 + got.moe_ms - 1e-9


def test_a_spread_placement_keeps_the_busiest_layers_whole_and_shares_the_rest_evenly():
    popularity = np.array([[5.0, 4, 3, 2], [9, 9, 9, 9], [1, 2, 3, 4]])
    on = sim.spread_placement(popularity, 4 + 3, whole=1)
    assert on[1].all()
    assert on.sum(axis=1).tolist() == [2, 4, 1]
    assert on[0].tolist() == [True, True, False, False] and on[2].tolist() == [False, False, False, True]


def test_a_copy_pays_when_its_extra_hits_outweigh_its_time():
    assert sim.break_even(PRICES, "stalled") == pytest.approx(125.0)  # 1.25 ms of copy against 0.01 ms a hit
    assert sim.break_even(PRICES, "overlapped") == pytest.approx(25.0)
    shape = TraceShape(4, 8, 2)  # 8 selections a step
    fixed = sim.Prediction(0.25, 0.0, 1.0, {})
    cache = sim.Prediction(0.5, 4.0, 1.0, {})
    assert sim.hits_per_copy(cache, fixed, shape) == pytest.approx(0.5)  # 2 more hits a step for 4 copies
    assert sim.hits_per_copy(fixed, fixed, shape) is None


def test_prices_from_a_profile_are_the_ones_the_engine_plans_and_swaps_with():
    from moedesk.engine.offload.expert_cache import SwapPrice
    from moedesk.engine.offload.latency_model import fit_latency_model
    from moedesk.engine.offload.placement import LayerCosts

    profile = {"cpu_expert_ms": {1: 0.07, 2: 0.065, 4: 0.078, 8: 0.116, 16: 0.18},
               "cpu_call_ms": {1: 0.11, 2: 0.11, 4: 0.13, 8: 0.22, 16: 0.38}, "cpu_call_experts": 4,
               "gpu_expert_ms": {1: 0.2, 16: 0.2}, "copy_expert_ms": 0.066, "activation_roundtrip_ms": 0.034,
               "expert_bytes": 2654208, "cpu_read_gbs": 148.0, "h2d_gbs": 40.2, "copy_launch_ms": 0.19,
               "resident_launch_ms": 0.47}
    prices = sim.StepPrices.from_profile(profile)
    model = fit_latency_model(profile)
    assert prices.layer_costs() == LayerCosts.from_model(model)
    assert prices.swap_price() == SwapPrice.from_model(model)
    assert prices.share_ms < 0.07  # a share of a call, less than a call of one expert
    assert (prices.link_gbs, prices.expert_bytes) == (40.2, 2654208)


def test_a_bad_profile_is_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "profile.json"
    bad.write_text('{"cpu_expert_ms": {}}')
    monkeypatch.setattr("sys.argv", ["simulate", "--shape", "mixtral-8x7b", "--profile", str(bad)])
    with pytest.raises(SystemExit):
        sim.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert "--profile" in err[-1] and "cpu_expert_ms" in err[-1] and "Traceback" not in "".join(err)
