"""tests/perf/simulate_expert_cache.py's pieces: the step's price, the copies', the LRU and clairvoyant caches, the
replay, on hand-made numbers and small traces (no GPU)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moedesk.engine.offload.expert_cache import CachePolicy, ExpertCache, replay
from moedesk.engine.offload.routing_trace import CONVERSATION, NO_LOCALITY, TraceShape, step_counts, synthetic_trace
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


# Prefetch from a predictor of the next layer's experts.

def test_the_predictor_keeps_each_true_expert_with_its_accuracy_and_fills_in_wrong_ones():
    rng = np.random.default_rng(0)
    chosen = np.array([3, 7, 9, 12])
    assert sorted(sim.predict(chosen, 16, 1.0, rng).tolist()) == [3, 7, 9, 12]
    wrong = sim.predict(chosen, 16, 0.0, rng)
    assert len(wrong) == 4 and not set(wrong.tolist()) & {3, 7, 9, 12}
    kept = [len(set(sim.predict(chosen, 16, 0.7, rng).tolist()) & {3, 7, 9, 12}) / 4 for _ in range(2000)]
    assert np.mean(kept) == pytest.approx(0.7, abs=0.02)


def test_copies_start_only_when_they_land_before_the_next_layer_needs_them():
    # 1 ms a copy; the link free now; a 2.5 ms window: two fit (batched: one launch, 0.25 ms, before them)
    assert sim.in_time(2, 0.0, 0.0, 2.5, PRICES, "batched")
    assert not sim.in_time(3, 0.0, 0.0, 2.5, PRICES, "batched")
    assert not sim.in_time(2, 0.0, 1.0, 2.5, PRICES, "batched")  # the link still busy with earlier copies
    assert sim.launches(3, PRICES, "overlapped") == pytest.approx(0.75)
    assert sim.launches(3, PRICES, "batched") == pytest.approx(0.25)


def test_a_perfect_predictor_with_time_to_copy_equals_the_clairvoyant_bound():
    shape = TraceShape(4, 16, 2)
    trace = conversation(shape, 80)
    resident = np.zeros((4, 16), dtype=bool)
    resident[0] = True  # no earlier layer predicts the first: keep it whole
    resident[1:, :2] = True
    staged = np.array([False, True, True, True])
    free_launch = replace(PRICES, share_ms=0.6, copy_launch_ms=0.0)  # hits on the GPU; copies queued for free
    bound_slots = resident.copy()
    bound_slots[1:, 2:6] = True  # the bound gets the staging area's 4 slots a layer as cache slots
    bound = sim.simulate(trace, sim.Clairvoyant(bound_slots, trace), free_launch, 1e6, warmup=1)
    for mode in sim.PREFETCH_MODES:
        run = sim.simulate_prefetch(trace, resident, staged, sim.Prefetch(1.0, 4), free_launch, 1e6, 1, mode)
        assert run.hit_rate == bound.hit_rate == 1.0
        assert run.moe_ms == pytest.approx(bound.moe_ms)
        assert run.step_ms == pytest.approx(bound.step_ms["batched"])
        assert run.skipped == 0.0 and run.copies_per_step > 0


def small_plan(calibration: np.ndarray):
    from moedesk.engine.offload.placement import plan_placement

    layers, experts = calibration.shape
    costs = replace(PRICES, share_ms=0.6).layer_costs()
    return lambda fits: plan_placement(1, layers, experts, calibration, fits, 0, layer_costs=costs, top_k=2).on_gpu


def test_the_staging_area_is_taken_from_the_resident_experts_budget():
    shape = TraceShape(8, 16, 2)
    calibration = sum(conversation(shape, 100)).astype(float)
    plan = small_plan(calibration)
    fits = 40
    full = plan(fits)
    resident, staged = sim.staged_placement(plan, fits, staging=2)
    assert not staged[0]
    assert staged[1:].tolist() == (~resident.all(axis=1))[1:].tolist()
    assert resident.sum() + 2 * staged.sum() <= fits
    assert resident.sum() < full.sum()  # the memory came out of the resident experts
    _, later = sim.staged_placement(plan, fits, staging=2, horizon=3)
    assert not later[:3].any()  # predicted three layers ahead: the first three have nothing early enough


@pytest.mark.parametrize("params", [CONVERSATION, NO_LOCALITY])
@pytest.mark.parametrize("mode", sim.PREFETCH_MODES)
def test_a_predictor_that_is_always_wrong_never_beats_the_fixed_placement(params, mode):
    shape = TraceShape(8, 16, 2)
    calibration = sum(step_counts(s, 16) for s in synthetic_trace(shape, 100, params, seed=9)).astype(float)
    trace = [step_counts(s, 16) for s in synthetic_trace(shape, 120, params, seed=4)]
    prices = replace(PRICES, share_ms=0.6)
    plan = small_plan(calibration)
    fixed = sim.simulate(trace, ExpertCache(plan(40), CachePolicy(swaps_per_step=0)), prices, 5.0, warmup=8)
    resident, staged = sim.staged_placement(plan, 40, staging=2)
    for seed in range(3):
        wrong = sim.simulate_prefetch(trace, resident, staged, sim.Prefetch(0.0, 2, seed=seed), prices, 5.0, 8, mode)
        assert wrong.step_ms >= fixed.step_ms["batched"]
    right = sim.simulate_prefetch(trace, resident, staged, sim.Prefetch(1.0, 2), prices, 50.0, 8, mode)
    assert right.hit_rate > fixed.hit_rate  # with time to copy, a perfect one does gain hits


@pytest.mark.parametrize("bad", [["--accuracy", "1.5"], ["--accuracy", "high"], ["--horizon", "0"]])
def test_a_bad_prefetch_option_is_one_line(bad, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["simulate", "--prefetch", *bad])
    with pytest.raises(SystemExit):
        sim.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert "--accuracy" in err[-1] and "Traceback" not in "".join(err)


# What the traces leave a cache to follow (--locality).

def test_reuse_is_chance_without_locality_and_above_it_with():
    shape = TraceShape(2, 64, 4)
    _, fresh = sim.reuse([step_counts(s, 64) for s in synthetic_trace(shape, 200, NO_LOCALITY, seed=1)])
    chance, again = sim.reuse(conversation(shape, 200))
    assert chance == pytest.approx(4 / 64)
    assert fresh == pytest.approx(chance, abs=0.02)
    assert again > 2 * chance
    repeated = [np.array([[1, 1, 0, 0]])] * 3
    assert sim.reuse(repeated) == (0.5, 1.0)


def test_the_best_fixed_placement_knowing_the_trace_takes_the_most_used():
    trace = [np.array([[3, 0, 1, 0], [0, 2, 0, 5]]), np.array([[3, 0, 0, 1], [0, 2, 0, 0]])]
    assert sim.hindsight_placement(trace, 2).tolist() == [[True, False, False, False], [False, False, False, True]]
    assert sim.hindsight_placement(trace, [1, 2]).tolist() == [[True, False, False, False],
                                                              [False, True, False, True]]


def test_belady_copies_each_expert_once_when_all_fit_and_evicts_the_one_needed_last():
    a, b, c = (np.eye(1, 3, k, dtype=int) for k in range(3))
    assert sim.belady_copies([a, b, a, b], 2) == pytest.approx(2 / 4)  # a and b, once each
    # one slot: a, b, a, b each a copy; three experts in two slots: a b c a b -> c evicts b (used after a), b again
    assert sim.belady_copies([a, b, a, b], 1) == 1.0
    assert sim.belady_copies([a, b, c, a, b], 2) == pytest.approx(4 / 5)
    trace = conversation(TraceShape(2, 16, 2), 80)
    assert sim.belady_copies(trace, 8) <= sim.belady_copies(trace, 4) < 4


@pytest.mark.parametrize("trace", ["conversation", "no locality"])
def test_on_mixtral_only_a_predictor_could_reach_the_target_and_on_qwen3_nothing(trace):
    # The box's session 37 fixed rows: Mixtral at 16 GiB 13.9 tok/s, Qwen3-30B-A3B at 8 GiB 13.2.
    rows = {r.placement: r for r in sim.locality_rows(sim.SETTINGS["mixtral-8x7b"], sim.PRICES["mixtral-8x7b"],
                                                     trace, 64, 8, 1000 / 13.9)}
    assert rows["fixed (the engine's plan)"].vs_fixed == pytest.approx(1.0)
    assert rows["every hit: clairvoyant, all layers, link free"].vs_fixed > 1.25  # the experts: 40% of the step
    assert max(r.vs_fixed for label, r in rows.items() if not label.startswith("every hit")) < 1.1
    qwen3 = sim.SETTINGS["qwen3-30b-a3b"]
    short = sim.Setting(sim.TraceShape(12, 128, 8), qwen3.resident * 12 // 48, qwen3.fixed_step_ms)
    rows = {r.placement: r for r in sim.locality_rows(short, sim.PRICES["qwen3-30b-a3b"], trace, 48, 8,
                                                     1000 / 13.2 / 4)}
    assert rows["every hit: clairvoyant, all layers, link free"].vs_fixed < 1.25  # the experts: 11% of the step


@pytest.mark.parametrize("bad", ["14", "14,x", "14,0"])
def test_a_bad_fixed_rate_is_one_line(bad, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["simulate", "--locality", "--fixed-tok-s", bad])
    with pytest.raises(SystemExit):
        sim.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert "--fixed-tok-s" in err[-1] and "Traceback" not in "".join(err)


def test_a_recorded_conversation_is_replayed_in_place_of_the_synthetic_ones(tmp_path, capsys, monkeypatch):
    from moedesk.engine.offload.routing_trace import write_trace

    shape = sim.SETTINGS["mixtral-8x7b"].shape
    path = tmp_path / "recorded.jsonl"
    prefill = [np.tile(np.arange(2), 5) for _ in range(shape.layers)]  # 5 tokens: left out
    write_trace(path, shape, [prefill, *synthetic_trace(shape, 40, CONVERSATION, seed=2)])
    calibration, trace = sim.read_recorded(path, shape)
    assert len(trace) == 20 and calibration.sum() == 20 * shape.layers * shape.top_k
    monkeypatch.setattr("sys.argv", ["simulate", "--locality", "--shape", "mixtral-8x7b", "--trace", str(path),
                                     "--warmup", "2", "--fixed-tok-s", "14"])
    assert sim.main() == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("recorded")]
    assert len(rows) == 8 and "every hit" in rows[-2]


@pytest.mark.parametrize("shape, steps, why", [("qwen3-30b-a3b", 3, "layers"), ("mixtral-8x7b", 3, "decode steps"),
                                               ("mixtral-8x7b", 20, "--warmup 16 leaves none timed")])
def test_a_recorded_trace_of_another_shape_or_too_short_is_one_line(shape, steps, why, tmp_path, capsys,
                                                                     monkeypatch):
    from moedesk.engine.offload.routing_trace import write_trace

    path = tmp_path / "short.jsonl"
    mixtral = sim.SETTINGS["mixtral-8x7b"].shape
    write_trace(path, mixtral, synthetic_trace(mixtral, steps, CONVERSATION))
    monkeypatch.setattr("sys.argv", ["simulate", "--locality", "--shape", shape, "--trace", str(path)])
    with pytest.raises(SystemExit):
        sim.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert "--trace" in err[-1] and why in err[-1] and "Traceback" not in "".join(err)


def test_the_routing_recorder_script_writes_a_trace_of_the_model_s_shape(tiny_checkpoint, tmp_path, capsys,
                                                                         monkeypatch):
    from moedesk.engine.offload.routing_trace import read_trace
    from tests.perf import record_routing

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEDESK_NO_CUDA_GRAPHS", "1")  # what the script sets, undone after the test
    folder, out = tiny_checkpoint("mixtral"), tmp_path / "routing.jsonl"
    monkeypatch.setattr("sys.argv", ["record", str(folder), "--prompt", "Hi there", "--prompt", "def f(x):",
                                     "--max-new-tokens", "5", "--device", "cpu", "--out", str(out)])
    assert record_routing.main() == 0
    shape, steps = read_trace(out)
    decode = [s for s in steps if len(s[0]) == shape.top_k]
    assert len(steps) == len(decode) + 2 and len(decode) == 2 * 4  # a prefill and 4 decode steps a prompt
    assert f"{len(steps)} steps" in capsys.readouterr().out


def test_the_routing_recorder_says_in_one_line_where_it_cannot_write(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from tests.perf import record_routing

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEDESK_NO_CUDA_GRAPHS", "1")  # what the script sets, undone after the test
    out = tmp_path / "missing" / "routing.jsonl"
    monkeypatch.setattr("sys.argv", ["record", str(tiny_checkpoint("mixtral")), "--prompt", "Hi", "--device", "cpu",
                                     "--out", str(out)])
    assert record_routing.main() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"record_routing: --out {out}") and not out.exists()
