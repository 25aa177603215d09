"""Placement by popularity and the per-step CPU/GPU split of offloaded experts, on hand-made numbers."""
import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.latency_model import fit_latency_model
from moedesk.engine.offload.assignment import (
    Assignment, Contended, Costs, assign_offloaded, assignment_for, copy_order, fiddler_assign, fiddler_rule,
    RememberedSplit, cpu_path_ms, finish_times,
)
from moedesk.engine.offload.placement import BudgetError, LayerCosts, plan_placement, step_cost_ms

MiB = 2**20


# --- placement -------------------------------------------------------------------------------

def place(popularity, budget, expert_bytes=100, non_expert=0, reserve=0):
    pop = np.asarray(popularity)
    return plan_placement(expert_bytes, pop.shape[0], pop.shape[1], pop, budget, non_expert, reserve)


def test_zero_budget_places_nothing():
    p = place([[5, 1], [3, 9]], budget=0)
    assert not p.on_gpu.any() and p.bytes_used == 0


def test_budget_that_only_holds_the_fixed_part_places_no_expert():
    p = place([[5, 1], [3, 9]], budget=350, non_expert=300, reserve=50)
    assert p.experts_on_gpu == 0 and p.bytes_used == 350


def test_huge_budget_places_everything():
    p = place(np.arange(12).reshape(3, 4), budget=10**15, non_expert=10**6)
    assert p.on_gpu.all() and p.experts_on_gpu == 12


COSTS = LayerCosts(roundtrip_ms=0.04, resident_launch_ms=0.2, cpu_expert_ms=0.06)


def test_step_cost_on_a_hand_made_placement():
    on_gpu = np.array([[True, True, True, True], [True, False, False, False], [False] * 4])
    popularity = np.array([[1, 1, 1, 1], [6, 2, 1, 1], [0, 0, 0, 0]])  # the last layer: no counts, spread evenly
    # layer 0: all resident, free; layer 1: 40% offloaded; layer 2: everything offloaded, nothing resident.
    expected = (0.04 + 0.2 + 2 * 0.4 * 0.06) + (0.04 + 2 * 1.0 * 0.06)
    assert step_cost_ms(on_gpu, popularity, 2, COSTS) == pytest.approx(expected)


def test_a_handed_over_layer_pays_no_resident_launch():
    on_gpu = np.array([[True, False, False, False], [True] * 4])
    popularity = np.array([[6, 2, 1, 1], [1, 1, 1, 1]])  # layer 0: 40% of the picks offloaded
    eager = LayerCosts(roundtrip_ms=0.04, resident_launch_ms=0.2, cpu_expert_ms=0.06, cpu_call_ms=0.1)
    handed = replace(eager, handed_over=True)
    assert step_cost_ms(on_gpu, popularity, 2, handed) == pytest.approx(0.04 + 0.1 + 2 * 0.4 * 0.06)
    assert step_cost_ms(on_gpu, popularity, 2, eager) == pytest.approx(0.04 + 0.1 + 2 * 0.4 * 0.06 + 0.2)


@pytest.mark.parametrize("launch_ms", [0.3, 0.6, 0.9, 1.5])
def test_skewed_routing_handed_over_keeps_every_pick_resident_whatever_the_launch_measured(launch_ms):
    # Whole Mixtral Q4_K on one GPU at 16 GiB (docs/measurements.md, "Session 45"): 151 experts fit and the routing
    # picks 4-5 experts a layer. Decode hands partly resident layers over, so popularity order, every pick
    # resident, wins at any launch the profile measures; priced as eager launches (the old rule), a launch measured
    # high enough chose 18 whole layers and left most picks on the CPU.
    popularity = np.zeros((32, 8))
    for layer in range(32):
        popularity[layer, :4 + layer % 2] = 10 + np.arange(4 + layer % 2)
    profile = LayerCosts(roundtrip_ms=0.041, resident_launch_ms=launch_ms, cpu_expert_ms=0.746, cpu_call_ms=0.169,
                         handed_over=True)
    plan = plan_placement(100, 32, 8, popularity, 151 * 100, 0, layer_costs=profile, top_k=2)
    assert plan.experts_on_gpu == 151 and plan.gpu_hit_rate(popularity) == 1.0
    eager = plan_placement(100, 32, 8, popularity, 151 * 100, 0, layer_costs=replace(profile, handed_over=False),
                           top_k=2)
    assert (eager.gpu_hit_rate(popularity) < 0.7) == (launch_ms >= 0.9)


def test_evenly_routed_experts_fill_whole_layers():
    # 12 layers of 16 experts routed almost evenly, room for a quarter of them: popularity order takes
    # the four slightly busier experts of every layer.
    popularity = np.full((12, 16), 100)
    popularity[:, 4:8] = 101
    spread = place(popularity, budget=48 * 100)
    assert not spread.on_gpu.all(axis=1).any()  # popularity order: no layer whole
    whole = plan_placement(100, 12, 16, popularity, 48 * 100, 0, layer_costs=COSTS, top_k=8)
    assert whole.experts_on_gpu == spread.experts_on_gpu == 48
    assert whole.on_gpu.all(axis=1).sum() == 3
    assert step_cost_ms(whole.on_gpu, popularity, 8, COSTS) < step_cost_ms(spread.on_gpu, popularity, 8, COSTS)


def test_whole_layers_pay_only_where_they_skip_the_host():
    # Even routing and a costly round trip: a whole layer saves its round trip only where the executor runs
    # it from the device alone (bf16 on Hopper). Elsewhere it still pays it, and popularity order wins.
    popularity = np.full((12, 16), 100)
    popularity[:, 4:8] = 101
    skips = LayerCosts(roundtrip_ms=0.3, resident_launch_ms=0.0, cpu_expert_ms=0.06)
    host_bound = LayerCosts(0.3, 0.0, 0.06, whole_layer_skips_host=False)
    assert plan_placement(100, 12, 16, popularity, 48 * 100, 0, layer_costs=skips, top_k=8).on_gpu.all(axis=1).sum() == 3
    plan = plan_placement(100, 12, 16, popularity, 48 * 100, 0, layer_costs=host_bound, top_k=8)
    assert np.array_equal(plan.on_gpu, place(popularity, budget=48 * 100).on_gpu)
    whole = np.zeros((12, 16), dtype=bool)
    whole[:3] = True
    assert step_cost_ms(whole, popularity, 8, host_bound) == pytest.approx(3 * 0.3 + 9 * (0.3 + 8 * 0.06))
    assert step_cost_ms(whole, popularity, 8, skips) == pytest.approx(9 * (0.3 + 8 * 0.06))


# Whole Qwen3-30B-A3B at 8 GiB routed evenly (docs/measurements.md, "Session 60"): 19 whole layers and 100 experts over,
# the box's profile (a call 0.1 ms, a lone token's expert 0.012 ms of it, the GPU's zero-copy share saving 0.02 ms).
QWEN3 = LayerCosts(roundtrip_ms=0.035, resident_launch_ms=0.4, cpu_expert_ms=0.012, cpu_call_ms=0.1, handed_over=True)


def _sampled_even(layers=48, experts=128, seed=0):
    return np.random.default_rng(seed).poisson(1000, size=(layers, experts)).astype(float)


def test_a_layer_with_nothing_resident_keeps_the_lone_token_split():
    popularity = np.array([[1, 1, 1, 1], [1, 1, 1, 1]])
    on_gpu = np.array([[True, False, False, False], [False] * 4])
    split = replace(COSTS, handed_over=True, lone_split_saving_ms=0.03)
    # only layer 1, with nothing resident, is shared with the GPU's zero-copy reads
    assert step_cost_ms(on_gpu, popularity, 2, split) == pytest.approx(
        step_cost_ms(on_gpu, popularity, 2, replace(split, lone_split_saving_ms=0.0)) - 0.03)


def test_experts_left_over_by_whole_layers_go_into_one_layer_where_the_split_pays():
    popularity = _sampled_even()
    fits = 19 * 128 + 100
    spread = plan_placement(100, 48, 128, popularity, fits * 100, 0, layer_costs=QWEN3, top_k=8)
    assert spread.on_gpu.all(axis=1).sum() == 19 and spread.on_gpu.any(axis=1).sum() > 20  # no split priced: spread
    split = replace(QWEN3, lone_split_saving_ms=0.02)
    packed = plan_placement(100, 48, 128, popularity, fits * 100, 0, layer_costs=split, top_k=8)
    assert packed.experts_on_gpu == fits and packed.on_gpu.all(axis=1).sum() == 19
    assert packed.on_gpu.any(axis=1).sum() == 20  # the 100 in one layer: the other 28 keep the split
    assert step_cost_ms(packed.on_gpu, popularity, 8, split) < step_cost_ms(spread.on_gpu, popularity, 8, split) - 0.4


def test_a_few_experts_left_over_stay_off_the_gpu_where_the_split_saves_more():
    popularity = _sampled_even(layers=8, experts=128)
    split = replace(QWEN3, lone_split_saving_ms=0.02)
    # 5 experts over: in one layer they would take 5/128 of its 8 picks (0.004 ms), less than the split it loses
    plan = plan_placement(100, 8, 128, popularity, (2 * 128 + 5) * 100, 0, layer_costs=split, top_k=8)
    assert plan.experts_on_gpu == 2 * 128 and plan.on_gpu.all(axis=1).sum() == 2
    assert plan.experts_room == 2 * 128 + 5  # what `moedesk profile` says was left free
    more = plan_placement(100, 8, 128, popularity, (2 * 128 + 60) * 100, 0, layer_costs=split, top_k=8)
    assert more.experts_on_gpu == more.experts_room == 2 * 128 + 60 and more.on_gpu.any(axis=1).sum() == 3
    every = plan_placement(100, 8, 128, popularity, 10**6, 0, layer_costs=split, top_k=8)
    assert every.experts_room == every.experts_on_gpu == 8 * 128  # room beyond every expert is not counted


def test_the_saving_is_the_profiles_chosen_split_against_the_cpu_alone():
    from types import SimpleNamespace

    from moedesk.engine.offload.assignment import lone_token_saving_ms

    ranks = SimpleNamespace(zero_copy_split_ms=(0.198, 0.1955, 0.178, 0.188, 0.242), zero_copy_top_k=8,
                            split_width_ms=((256, 0.1877),))
    assert lone_token_saving_ms(ranks) == pytest.approx(0.198 - 0.178)  # two whole experts; rows not 5% better
    rows = replace_ns(ranks, split_width_ms=((256, 0.15),))
    assert lone_token_saving_ms(rows) == pytest.approx(0.198 - 0.15)
    flat = replace_ns(ranks, zero_copy_split_ms=(0.2, 0.199, 0.21), split_width_ms=())
    assert lone_token_saving_ms(flat) == 0.0  # within ZERO_COPY_MIN_GAIN: the CPU alone
    assert lone_token_saving_ms(SimpleNamespace()) == 0.0  # nothing measured


def test_from_model_prices_the_split_only_where_the_executor_makes_it():
    from moedesk.engine.offload.latency_model import LatencyModel

    costs = LatencyModel(0.1, 0.01, 0.05, (1, 8), (0.2, 0.3), 0.2, zero_copy_split_ms=(0.69, 0.68, 0.6),
                         zero_copy_top_k=2)
    assert LayerCosts.from_model(costs, splits_lone_tokens=True).lone_split_saving_ms == pytest.approx(0.09)
    assert LayerCosts.from_model(costs).lone_split_saving_ms == 0.0


def replace_ns(ns, **changes):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(ns), **changes})


def test_skewed_routing_keeps_popularity_order():
    # Two hot experts per layer take almost every token, and a CPU expert is slow (Mixtral's): popularity
    # covers them in every layer with the budget of one whole layer, and saves more.
    popularity = np.ones((8, 16), dtype=int)
    popularity[:, :2] = 1000
    by_popularity = place(popularity, budget=16 * 100)
    slow_cpu = LayerCosts(roundtrip_ms=0.04, resident_launch_ms=0.2, cpu_expert_ms=3.0)
    with_costs = plan_placement(100, 8, 16, popularity, 16 * 100, 0, layer_costs=slow_cpu, top_k=2)
    assert np.array_equal(with_costs.on_gpu, by_popularity.on_gpu)


def test_whole_layers_go_to_the_busiest_layers_and_keep_the_budget():
    popularity = np.full((4, 8), 10)
    popularity[2] = 30  # the busiest layer
    plan = plan_placement(100, 4, 8, popularity, 11 * 100 + 50, 0, layer_costs=COSTS, top_k=2)
    assert plan.experts_on_gpu == 11 and plan.on_gpu[2].all() and plan.on_gpu.all(axis=1).sum() == 1


def test_budget_is_filled_but_never_exceeded():
    rng = np.random.default_rng(0)
    pop = rng.integers(0, 100, size=(6, 8))
    for budget in (0, 99, 100, 1234, 4799, 4800, 10**6):
        p = place(pop, budget=budget + 700, non_expert=500, reserve=200)
        assert p.bytes_used <= p.budget_bytes
        assert p.experts_on_gpu == min(budget // 100, 48)  # one more would not fit
        assert p.expert_bytes_used == 100 * p.experts_on_gpu


def test_non_expert_weights_that_do_not_fit_raise_a_moedesk_error():
    with pytest.raises(BudgetError, match="non-expert weights") as err:
        place([[1, 2]], budget=1000, non_expert=900, reserve=200)
    assert isinstance(err.value, MoedeskError)
    assert "\n" not in str(err.value)


def test_most_popular_experts_win_across_layers_not_per_layer():
    # Layer 1 holds the three hottest experts: they all go, layer 0 gets none.
    p = place([[10, 20, 30], [90, 80, 70]], budget=300)
    assert p.on_gpu.tolist() == [[False, False, False], [True, True, True]]
    # And in general every resident expert is at least as popular as every offloaded one.
    pop = np.random.default_rng(1).integers(0, 50, size=(5, 7))
    q = place(pop, budget=1300)
    assert pop[q.on_gpu].min() >= pop[~q.on_gpu].max()


def test_ties_break_by_layer_then_expert():
    p = place([[5, 5, 5], [5, 5, 5]], budget=400)
    assert p.on_gpu.tolist() == [[True, True, True], [True, False, False]]
    q = place([[1, 7, 7], [7, 0, 7]], budget=300)
    assert q.on_gpu.tolist() == [[False, True, True], [True, False, False]]


def test_placement_is_deterministic_and_read_only():
    pop = np.random.default_rng(2).integers(0, 3, size=(4, 16))  # many ties
    a, b = place(pop, budget=2000), place(pop.tolist(), budget=2000)
    assert (a.on_gpu == b.on_gpu).all()
    with pytest.raises(ValueError):
        a.on_gpu[0, 0] = not a.on_gpu[0, 0]
    assert a.as_lists() == a.on_gpu.tolist() and isinstance(a.as_lists()[0][0], bool)


def test_hit_rate_is_the_share_of_selections_on_the_gpu():
    pop = [[10, 0, 30], [40, 15, 5]]
    p = place(pop, budget=200)  # 40 and 30
    assert p.gpu_hit_rate(pop) == pytest.approx(70 / 100)
    assert place(pop, budget=0).gpu_hit_rate(pop) == 0.0
    assert place(pop, budget=10**9).gpu_hit_rate(pop) == 1.0
    assert p.gpu_hit_rate(np.zeros((2, 3))) == 0.0


def test_popularity_placement_beats_any_other_of_the_same_size():
    rng = np.random.default_rng(3)
    pop = rng.zipf(1.5, size=(4, 8)).astype(float)
    best = place(pop, budget=1000)
    for _ in range(200):
        other = np.zeros(32, dtype=bool)
        other[rng.choice(32, 10, replace=False)] = True
        assert best.gpu_hit_rate(pop) >= pop.ravel()[other].sum() / pop.sum() - 1e-12


def test_popularity_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="shape"):
        plan_placement(100, 2, 3, np.ones((3, 2)), 1000, 0)
    with pytest.raises(ValueError):
        place([[1, -1]], budget=1000)


# --- per-step assignment ----------------------------------------------------------------------

def Table(cpu: dict, gpu: dict, copy_expert_ms: float, roundtrip_ms: float = 0.0) -> Costs:
    """Hand-made latencies by token count, not necessarily monotone: the rules must not rely on shapes."""
    return Costs(cpu.__getitem__, gpu.__getitem__, copy_expert_ms, roundtrip_ms)


def random_case(rng: random.Random, n_experts: int, max_tokens: int):
    table = Table(cpu={n: rng.uniform(0.1, 10) for n in range(1, max_tokens + 1)},
                  gpu={n: rng.uniform(0.0, 6) for n in range(1, max_tokens + 1)},
                  copy_expert_ms=rng.choice([0.0, rng.uniform(0.1, 6)]), roundtrip_ms=rng.uniform(0, 0.3))
    loads = {e: rng.randint(1, max_tokens) for e in rng.sample(range(64), n_experts)}
    busy = rng.choice([0.0, rng.uniform(0, 8)])
    return loads, table, busy


def brute_force(loads, model, busy, all_orders: bool) -> float:
    """Best makespan over every subset to copy, and every copy order when all_orders."""
    experts, best = list(loads), float("inf")
    for r in range(len(experts) + 1):
        for subset in itertools.combinations(experts, r):
            orders = itertools.permutations(subset) if all_orders else [copy_order(loads, subset, model)]
            for order in orders:
                best = min(best, max(finish_times(loads, order, model, busy)))
    return best


@pytest.mark.parametrize("seed, cases, experts, all_orders", [
    (0, 400, (1, 6), True),  # every subset and every copy order: Johnson's order (descending GPU time) is best
    (1, 40, (7, 12), False),  # larger steps: every subset, in the chosen order
])
def test_exact_split_equals_brute_force(seed, cases, experts, all_orders):
    rng = random.Random(seed)
    for _ in range(cases):
        n = rng.randint(*experts)
        loads, table, busy = random_case(rng, n, rng.randint(1, 6) if all_orders else rng.randint(2, 12))
        got = assign_offloaded(loads, table, busy)
        assert got.method == "exact"
        assert got.makespan_ms == pytest.approx(brute_force(loads, table, busy, all_orders=all_orders), abs=1e-9)


def test_reported_times_are_those_of_the_returned_split():
    rng = random.Random(2)
    for limit in (None, 0):  # exact, then greedy
        for _ in range(100):
            loads, table, busy = random_case(rng, rng.randint(1, 30), rng.randint(1, 8))
            got = assign_offloaded(loads, table, busy, **({} if limit is None else {"exact_limit": limit}))
            assert sorted(got.cpu + got.copy) == sorted(loads) and not set(got.cpu) & set(got.copy)
            assert list(got.cpu) == sorted(got.cpu)
            cpu, gpu = finish_times(loads, got.copy, table, busy)
            assert (got.cpu_finish_ms, got.gpu_finish_ms) == (pytest.approx(cpu), pytest.approx(gpu))


def test_the_best_split_need_not_copy_the_most_loaded_experts():
    # Prefix splits by load miss it: copying the 3-token expert {A} or {A, B} gives 11 / 10.1,
    # copying the two small ones gives 10.
    table = Table(cpu={3: 10.0, 2: 6.0, 1: 5.0}, gpu={3: 9.0, 2: 0.1, 1: 0.1}, copy_expert_ms=1.0)
    got = assign_offloaded({0: 3, 1: 2, 2: 1}, table)
    assert got.cpu == (0,) and set(got.copy) == {1, 2}
    assert got.makespan_ms == pytest.approx(10.0)


def test_partition_instance_is_solved_exactly():
    # CPU and GPU times equal and free copies: the best split halves the total (3+1+1+2+2+1 = 10 -> 5).
    sizes = {1: 3.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0, 6: 1.0}
    table = Table(cpu=sizes, gpu=sizes, copy_expert_ms=0.0)
    got = assign_offloaded({e: e for e in sizes}, table)
    assert got.makespan_ms == pytest.approx(5.0)


def test_never_worse_than_fiddler_all_cpu_or_all_gpu():
    rng = random.Random(3)
    for limit in (None, 0):
        for _ in range(150):
            loads, table, busy = random_case(rng, rng.randint(1, 40), rng.randint(1, 10))
            got = assign_offloaded(loads, table, busy, **({} if limit is None else {"exact_limit": limit}))
            for other in (fiddler_assign(loads, table, busy), assignment_for(loads, [], table, busy),
                          assignment_for(loads, list(loads), table, busy)):
                assert got.makespan_ms <= other.makespan_ms + 1e-9


def test_remembered_split_answers_like_the_rule_and_searches_once_per_multiset_of_loads():
    rng = random.Random(5)
    for _ in range(60):
        loads, table, busy = random_case(rng, rng.randint(1, 12), rng.randint(1, 4))
        calls = []

        def rule(l):
            calls.append(l)
            return assign_offloaded(l, table, busy)

        remembered = RememberedSplit(rule)
        cpu, copy = remembered(loads)
        assert sorted(cpu + copy) == sorted(loads) and cpu == sorted(cpu)
        direct = assign_offloaded(loads, table, busy)
        assert max(finish_times(loads, copy, table, busy)) == pytest.approx(direct.makespan_ms)
        # The same loads on other experts (another layer, another step): mapped, not searched again.
        renamed = dict(zip(rng.sample(range(100, 200), len(loads)), rng.sample(list(loads.values()), len(loads))))
        cpu2, copy2 = remembered({**renamed, 999: 0})  # an expert without tokens is ignored
        assert len(calls) == 1 and sorted(cpu2 + copy2) == sorted(renamed)
        assert sorted(renamed[e] for e in copy2) == sorted(loads[e] for e in copy)
        assert max(finish_times(renamed, copy2, table, busy)) == pytest.approx(direct.makespan_ms)


def test_remembered_split_forgets_when_full():
    remembered = RememberedSplit(lambda l: (list(l), []), capacity=2)
    for n in range(1, 6):
        assert remembered({7: n}) == ([7], [])
    assert len(remembered.memory) <= 2


def test_greedy_only_above_the_exact_limit():
    table = Table(cpu={n: 1.0 + n for n in range(1, 41)}, gpu={n: 0.5 + n / 100 for n in range(1, 41)},
                  copy_expert_ms=2.0)
    sixteen_distinct = {e: e + 1 for e in range(16)}
    assert assign_offloaded(sixteen_distinct, table).method == "exact"
    assert assign_offloaded({e: e + 1 for e in range(40)}, table).method == "greedy"
    # 60 experts with only two loads are 31 x 31 choices: still exact.
    assert assign_offloaded({e: 1 + e % 2 for e in range(60)}, table).method == "exact"


def test_balanced_split_beats_fiddler_at_decode():
    # The GPU box's first Mixtral numbers (docs/measurements.md): 5 ms on the CPU, 6.5 ms copy, 0.17 ms on the GPU.
    # Fiddler keeps both 1-token experts on the CPU (10 ms); copying one while the CPU runs the other ends at 6.67 ms.
    table = Table(cpu={1: 5.0}, gpu={1: 0.17}, copy_expert_ms=6.5)
    assert fiddler_rule(1, table) == "cpu"
    fiddler = fiddler_assign({3: 1, 5: 1}, table)
    got = assign_offloaded({3: 1, 5: 1}, table)
    assert fiddler.copy == () and fiddler.makespan_ms == pytest.approx(10.0)
    assert len(got.copy) == 1 and got.makespan_ms == pytest.approx(6.67)


def test_fiddler_rule_copies_only_when_the_cpu_is_slower_than_copy_plus_gpu():
    table = Table(cpu={1: 5.0, 2: 7.0, 3: 9.0}, gpu={1: 1.0, 2: 1.0, 3: 1.0}, copy_expert_ms=6.0)
    assert [fiddler_rule(n, table) for n in (1, 2, 3)] == ["cpu", "cpu", "gpu"]  # 7 == 1 + 6 stays


def test_copies_are_issued_by_descending_gpu_time():
    table = Table(cpu={n: 100.0 for n in range(1, 5)}, gpu={1: 0.5, 2: 3.0, 3: 1.0, 4: 3.0}, copy_expert_ms=2.0)
    got = assign_offloaded({10: 1, 11: 2, 12: 3, 13: 4}, table)
    assert got.copy == (13, 11, 12, 10)  # 3.0 ms twice (heavier load first), then 1.0, then 0.5
    assert list(got.copy) == copy_order({10: 1, 11: 2, 12: 3, 13: 4}, [10, 11, 12, 13], table)


def test_busy_gpu_pushes_work_to_the_cpu():
    table = Table(cpu={4: 3.0}, gpu={4: 0.2}, copy_expert_ms=1.0)
    assert len(assign_offloaded({0: 4, 1: 4, 2: 4}, table).copy) == 2
    late = assign_offloaded({0: 4, 1: 4, 2: 4}, table, gpu_busy_ms=100.0)
    assert late.copy == () and late.gpu_finish_ms == 100.0


def test_cpu_path_pays_the_activation_round_trip():
    table = Table(cpu={2: 3.0}, gpu={2: 0.2}, copy_expert_ms=3.2, roundtrip_ms=0.5)
    assert finish_times({0: 2, 1: 2}, [1], table) == (pytest.approx(3.5), pytest.approx(3.4))
    # 3.0 + 0.5 on the CPU path loses to 3.2 + 0.2 copied; without the round trip the CPU's 3.0 wins.
    assert assign_offloaded({0: 2}, table).copy == (0,)
    assert assign_offloaded({0: 2}, Table(cpu={2: 3.0}, gpu={2: 0.2}, copy_expert_ms=3.2)).copy == ()


def test_experts_without_tokens_are_ignored():
    table = Table(cpu={2: 3.0}, gpu={2: 0.2}, copy_expert_ms=1.0)
    assert assign_offloaded({}, table).makespan_ms == 0.0
    got = assign_offloaded({0: 0, 1: 2, 2: 0}, table)
    assert set(got.cpu + got.copy) == {1}


def test_assignment_is_deterministic_and_unpacks_for_the_executor():
    rng = random.Random(4)
    loads, table, busy = random_case(rng, 12, 3)  # many equal loads: many equally good splits
    a = assign_offloaded(loads, table, busy)
    b = assign_offloaded(dict(reversed(list(loads.items()))), table, busy)
    assert a == b
    cpu, copy = a  # OffloadExecutor's decide() contract
    assert cpu == list(a.cpu) and copy == list(a.copy) and isinstance(a, Assignment)


def test_works_on_a_fitted_latency_model():
    model = fit_latency_model({
        "cpu_expert_ms": {1: 5.0, 4: 5.0, 16: 5.2, 64: 19.0, 256: 77.0},
        "gpu_expert_ms": {1: 0.17, 512: 0.32, 4096: 2.1}, "copy_expert_ms": 6.5,
        "activation_roundtrip_ms": 0.045, "expert_bytes": 352 * MiB, "cpu_read_gbs": 102.0,
    })
    loads = {e: 128 for e in range(8)}  # 128 tokens each: ~38 ms on the CPU, 6.5 ms to copy
    prefill = assign_offloaded(loads, model)
    assert len(prefill.copy) >= 6 and prefill.makespan_ms <= fiddler_assign(loads, model).makespan_ms + 1e-9
    decode = assign_offloaded({2: 1, 6: 1}, model)
    assert decode.makespan_ms < 2 * model.cpu_expert_ms(1)


def _slowed(costs: Costs, cpu_slowdown: float = 1.0, copy_slowdown: float = 1.0, copy_launch_ms: float = 0.0):
    """Costs plus the contention factors and the copy launch time a fitted LatencyModel carries."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Slowed(Costs):
        cpu_slowdown: float = 1.0
        copy_slowdown: float = 1.0
        copy_launch_ms: float = 0.0

        def slowdowns(self, tokens: float) -> tuple[float, float]:
            return self.cpu_slowdown, self.copy_slowdown

    return Slowed(costs.cpu_ms, costs.gpu_ms, costs.copy_ms, costs.roundtrip_ms, cpu_slowdown, copy_slowdown,
                  copy_launch_ms)


def test_exact_split_with_copy_launch_cost_equals_brute_force():
    """Each copy costs the host thread time before it joins the CPU pool; experts cheaper than that stay."""
    rng = random.Random(5)
    stayed = 0
    for _ in range(150):
        loads, table, busy = random_case(rng, rng.randint(1, 9), rng.randint(1, 6))
        model = _slowed(table, copy_launch_ms=rng.choice([0.05, rng.uniform(0, 4)]))
        got = assign_offloaded(loads, model, busy)
        assert got.method == "exact" and sorted(got.cpu + got.copy) == sorted(loads)
        assert got.makespan_ms == pytest.approx(brute_force(loads, model, busy, all_orders=False), abs=1e-9)
        assert (got.cpu_finish_ms, got.gpu_finish_ms) == tuple(map(pytest.approx, finish_times(loads, got.copy, model, busy)))
        stayed += any(cpu_path_ms(n, model) <= model.copy_launch_ms for n in loads.values())
    assert stayed > 10  # the experts-that-stay path ran


def test_launch_cost_keeps_small_experts_on_the_cpu():
    # Qwen3-like decode step: 0.1 ms per expert on the CPU, copying is quick but each costs 0.2 ms to queue.
    costs = Costs(lambda n: 0.1, lambda n: 0.08, 0.19)
    loads = {e: 1 for e in range(8)}
    assert assign_offloaded(loads, costs).copy  # free launches: a split
    got = assign_offloaded(loads, _slowed(costs, copy_launch_ms=0.2))
    assert got.copy == () and got.makespan_ms == pytest.approx(0.8)


def test_contention_turns_a_split_into_all_copied():
    # Eight one-token experts: 1 ms each on the CPU, 0.2 ms to copy, 0.1 ms on the GPU.
    costs = Costs(lambda n: 1.0, lambda n: 0.1, 0.2)
    loads = {e: 1 for e in range(8)}
    free = assign_offloaded(loads, costs)  # copy 7: max(CPU 1, link 1.4 + GPU 0.1) = 1.5
    assert len(free.copy) == 7 and free.makespan_ms == pytest.approx(1.5)
    # Both sides twice as slow while both run: the best split, copy 7, takes max(2, 2.9); copying all
    # 8 runs nothing on the CPU, so nothing slows the link: 8 x 0.2 + 0.1.
    slowed = assign_offloaded(loads, _slowed(costs, 2.0, 2.0))
    assert set(slowed.copy) == set(loads) and slowed.makespan_ms == pytest.approx(1.7)


def test_contention_turns_a_split_into_all_cpu():
    costs = Costs(lambda n: 3.0, lambda n: 0.2, 4.0)
    loads = {0: 1, 1: 1}
    free = assign_offloaded(loads, costs)  # split: max(3, 4.2); all-CPU 6; all-copied 8.2
    assert len(free.copy) == 1 and free.makespan_ms == pytest.approx(4.2)
    slowed = assign_offloaded(loads, _slowed(costs, 2.0, 1.5))  # split: max(6, 6.2)
    assert slowed.copy == () and slowed.makespan_ms == pytest.approx(6.0)


def test_mild_contention_keeps_the_split_at_its_contended_cost():
    costs = Costs(lambda n: 3.0, lambda n: 0.2, 4.0)
    slowed = assign_offloaded({0: 1, 1: 1}, _slowed(costs, 1.2, 1.1))  # split: max(3.6, 4.6) < all-CPU 6
    assert len(slowed.copy) == 1 and slowed.makespan_ms == pytest.approx(4.6)


def test_contention_is_taken_at_the_steps_tokens_per_expert():
    """Copies slow a CPU expert that waits on RAM (one token) far more than one its arithmetic holds (16 sequences'
    ~4 tokens each): a batched step splits by the factors measured at its own load."""
    from moedesk.engine.offload.latency_model import LatencyModel

    def model(contention):
        return LatencyModel(cpu_intercept_ms=1.0, cpu_per_token_ms=0.0, cpu_floor_ms=1.0, gpu_tokens=(1,),
                            gpu_ms=(0.1,), copy_expert_ms=1.8, contention=contention)

    by_tokens = model(((1, 1.9, 1.1), (4, 1.05, 1.1)))
    batched = {e: 4 for e in range(8)}
    # Three copies: the CPU's five take 5 x 1.05, the link 3 x 1.98 and the last GPU compute 0.1.
    got = assign_offloaded(batched, by_tokens)
    assert len(got.copy) == 3 and got.makespan_ms == pytest.approx(6.04)
    # The one-token factors for every load would keep all eight on the CPU (8.0 against four copies' 8.02).
    assert assign_offloaded(batched, model(((1, 1.9, 1.1),))).copy == ()
    assert assign_offloaded({e: 1 for e in range(8)}, by_tokens).copy == ()


def test_a_lone_tokens_experts_stay_on_the_cpu_where_the_profile_measured_the_gpus_options():
    """Priced from one expert's costs, copying one of Mixtral's two experts at one token looks faster (a call of
    both costs the CPU less than twice one expert's); the profile measured streaming (lone_token_split), which
    moves a copy's bytes without its staging, so a lone token's experts stay on the CPU. Not for more experts
    than the profile streamed (a batch of two: four experts), nor where nothing was measured."""
    from dataclasses import replace

    from moedesk.engine.offload.latency_model import LatencyModel
    from moedesk.engine.offload.assignment import lone_token_measured

    predicted = LatencyModel(cpu_intercept_ms=1.16, cpu_per_token_ms=0.0, cpu_floor_ms=1.16, gpu_tokens=(1,),
                             gpu_ms=(0.23,), copy_expert_ms=1.85, contention=((1, 1.05, 1.01),))
    lone = {3: 1, 6: 1}
    assert assign_offloaded(lone, predicted).copy != ()  # the prediction: 2.10 ms copying one against 2.32
    measured = replace(predicted, zero_copy_split_ms=(1.96, 2.33), zero_copy_top_k=2)
    got = assign_offloaded(lone, measured)
    assert (got.cpu, got.copy, got.method) == ((3, 6), (), "measured")
    assert lone_token_measured(lone, measured) and lone_token_measured({3: 1}, measured)
    batch_of_two = {e: 1 for e in range(4)}
    assert not lone_token_measured(batch_of_two, measured)
    assert assign_offloaded(batch_of_two, measured) == assign_offloaded(batch_of_two, predicted)
    assert not lone_token_measured({3: 2, 6: 1}, measured)  # two tokens on one expert
    assert not lone_token_measured(lone, replace(measured, zero_copy_split_ms=(1.96,)))  # nothing to compare


def _with_call(costs: Costs, call_ms: float, copy_launch_ms: float = 0.0):
    """Costs plus a CPU call's own cost at every load (a fitted LatencyModel's cpu_call_ms) and a copy launch."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Called(Costs):
        call_ms: float = 0.0
        copy_launch_ms: float = 0.0

        def cpu_call_ms(self, tokens: float) -> float:
            return self.call_ms

    return Called(costs.cpu_ms, costs.gpu_ms, costs.copy_ms, costs.roundtrip_ms, call_ms, copy_launch_ms)


def test_the_cpu_calls_own_cost_is_paid_once_and_only_with_an_expert_on_the_cpu():
    model = _with_call(Costs(lambda n: 1.0, lambda n: 0.1, 0.2), call_ms=0.5)
    loads = {e: 1 for e in range(3)}
    assert finish_times(loads, [], model) == pytest.approx((3.5, 0.0))
    assert finish_times(loads, [0, 1], model)[0] == pytest.approx(1.5)
    assert finish_times(loads, [0, 1, 2], model)[0] == 0.0


def test_exact_split_with_the_cpu_calls_own_cost_equals_brute_force():
    rng = random.Random(7)
    all_copied = some_stay = 0
    for _ in range(150):
        loads, table, busy = random_case(rng, rng.randint(1, 9), rng.randint(1, 6))
        model = _with_call(table, rng.uniform(0, 5), rng.choice([0.0, rng.uniform(0, 2)]))
        got = assign_offloaded(loads, model, busy)
        assert got.makespan_ms == pytest.approx(brute_force(loads, model, busy, all_orders=False), abs=1e-9)
        assert (got.cpu_finish_ms, got.gpu_finish_ms) == tuple(map(pytest.approx, finish_times(loads, got.copy, model, busy)))
        all_copied += not got.cpu
        some_stay += any(cpu_path_ms(n, model) <= model.copy_launch_ms for n in loads.values())
    assert all_copied > 5 and some_stay > 5  # copying everything saved the call; the stay path ran


def test_an_expert_priced_at_its_share_of_the_call_copies_less_than_priced_at_its_own_call():
    """16 sequences on Mixtral's 8 experts, 4 tokens each: one expert alone in a call takes 1.22 ms, each of
    eight in one call 1.10 (the call's own 0.137 and a share of 1.083). Priced at its own call, the CPU side
    looks dearer and the split copies four; priced from the call's parts, three."""
    share = Costs(lambda n: 1.083, lambda n: 0.25, 1.35)
    alone = Costs(lambda n: 1.22, lambda n: 0.25, 1.35)
    loads = {e: 4 for e in range(8)}
    assert len(assign_offloaded(loads, alone).copy) == 4
    got = assign_offloaded(loads, _with_call(share, 0.137))
    assert len(got.copy) == 3 and got.cpu_finish_ms == pytest.approx(0.137 + 5 * 1.083)


def test_all_experts_under_a_launch_skip_the_search(monkeypatch):
    import moedesk.engine.offload.assignment as assignment

    monkeypatch.setattr(assignment, "_best_split", lambda *a: pytest.fail("searched"))
    got = assign_offloaded({3: 1, 9: 2}, _slowed(Costs(lambda n: 0.05 * n, lambda n: 0.07, 0.19), copy_launch_ms=0.2))
    assert got.cpu == (3, 9) and got.copy == () and got.makespan_ms == pytest.approx(0.15)


def test_a_step_in_copy_runs_searches_though_each_expert_is_cheaper_than_a_lone_copys_launch():
    # Each expert costs the CPU less than queueing a lone copy and its launch, so a decode step stays on the CPU
    # unsearched; in copy runs a copy costs the host its queueing alone and the step one launch, so the faster link
    # takes most of them (it was all-CPU, at four times the makespan).
    model = _slowed(Costs(lambda n: 0.02 * n, lambda n: 0.01, 0.01), copy_launch_ms=0.5)
    loads = {e: 8 for e in range(16)}
    alone = assign_offloaded(loads, model, overlap=True)
    assert alone.copy == () and alone.makespan_ms == pytest.approx(16 * 0.16)
    got = assign_offloaded(loads, model, overlap=True, grouped_copies=True)
    assert 10 <= len(got.copy) <= 14 and got.makespan_ms < alone.makespan_ms / 3
    assert got.makespan_ms == pytest.approx(max(finish_times(loads, got.copy, Contended(
        model, 8.0, overlap=True, grouped_copies=True))))


class _WithResidentLaunch:
    def __init__(self, costs: Costs, resident_launch_ms: float):
        self.costs, self.resident_launch_ms = costs, resident_launch_ms

    def cpu_expert_ms(self, tokens: int) -> float:
        return self.costs.cpu_expert_ms(tokens)


def test_resident_experts_go_to_the_cpu_only_when_that_beats_launching_the_gpu_share():
    from moedesk.engine.offload.assignment import resident_on_cpu

    model = _WithResidentLaunch(Costs(lambda n: 0.05 * n, lambda n: 0.01, 1.0), resident_launch_ms=0.2)
    assert resident_on_cpu({7: 1, 3: 1}, model) == [3, 7]  # 0.1 ms of CPU work < 0.2 ms of launches
    assert resident_on_cpu({7: 1, 3: 1, 5: 0}, model) == [3, 7]  # no tokens: not active
    assert resident_on_cpu({1: 1, 2: 1, 3: 1, 4: 1}, model) == []  # 0.2 ms: not cheaper, all stay
    assert resident_on_cpu({1: 5}, model) == []  # more tokens, more CPU work
    assert resident_on_cpu({}, model) == []
    assert resident_on_cpu({1: 1}, Costs(lambda n: 0.05, lambda n: 0.01, 1.0)) == []  # nothing measured: stay


def test_zero_copy_ranks_take_the_fastest_measured_split():
    from types import SimpleNamespace

    from moedesk.engine.offload.assignment import zero_copy_ranks

    def measured(*split_ms, top_k=8):
        return SimpleNamespace(zero_copy_split_ms=split_ms, zero_copy_top_k=top_k)

    assert zero_copy_ranks(8, measured(0.68, 0.62, 0.54, 0.57)) == 2
    assert zero_copy_ranks(8, measured(0.68, 0.54, 0.54)) == 1  # a tie: the fewer
    assert zero_copy_ranks(2, measured(5.8, 7.3, top_k=2)) == 0  # Mixtral: the GPU's share takes longer
    assert zero_copy_ranks(8, measured(0.68, 0.66, 0.65)) == 0  # under 5% faster: not worth the change
    assert zero_copy_ranks(4, measured(0.68, 0.3, 0.2)) == 0  # measured for another top_k
    assert zero_copy_ranks(8, measured(0.68)) == 0 and zero_copy_ranks(8, measured()) == 0  # nothing to choose
    assert zero_copy_ranks(8, Costs(lambda n: 0.08, lambda n: 0.01, 1.0)) == 0  # a model without the measurement


def test_rows_split_when_they_beat_whole_experts():
    """Mixtral's top-2: one whole expert over PCIe takes longer than both on the CPU, a quarter of every
    expert's rows does not (split_width_ms); the fastest option wins, whole experts or rows, never both."""
    from types import SimpleNamespace

    from moedesk.engine.offload.assignment import lone_token_split, split_width, zero_copy_ranks

    def measured(split_ms, rows_ms, top_k=2):
        return SimpleNamespace(zero_copy_split_ms=split_ms, zero_copy_top_k=top_k, split_width_ms=rows_ms)

    mixtral = measured((1.46, 2.1, 4.0), ((1792, 1.3), (3584, 1.1), (5376, 1.2)))
    assert lone_token_split(2, mixtral) == (0, 3584)
    assert (zero_copy_ranks(2, mixtral), split_width(2, mixtral)) == (0, 3584)
    assert lone_token_split(2, measured((1.46, 1.0, 4.0), ((3584, 1.1),))) == (1, 0)  # a whole expert was faster
    assert lone_token_split(2, measured((1.46, 2.1), ((3584, 1.42),))) == (0, 0)  # under 5% faster
    assert lone_token_split(8, mixtral) == (0, 0)  # measured for another top_k
    assert lone_token_split(2, measured((1.46,), ((3584, 1.1),))) == (0, 0)  # no CPU-alone time to beat


def test_a_width_must_clearly_beat_whole_experts():
    """Session 49's gpt-oss profiles (top-4, ms): one whole expert on the GPU 0.537, the best width 0.523; chosen,
    the width decoded 10% slower than one whole expert on the same machine. A width takes over only where it leads
    the best whole-expert option by ZERO_COPY_MIN_GAIN, as that option must lead the CPU alone."""
    from types import SimpleNamespace

    from moedesk.engine.offload.assignment import lone_token_split

    def measured(split_ms, rows_ms):
        return SimpleNamespace(zero_copy_split_ms=split_ms, zero_copy_top_k=len(split_ms) - 1, split_width_ms=rows_ms)

    gpt_oss = measured((0.577, 0.537, 0.700, 0.94, 1.21), ((512, 0.55), (896, 0.523)))
    assert lone_token_split(4, gpt_oss) == (1, 0)
    assert lone_token_split(2, measured((0.577, 0.537, 0.700), ((896, 0.50),))) == (0, 896)  # 7% ahead
    # no whole expert beats the CPU alone: the width is weighed against the CPU alone (session 49's Mixtral)
    assert lone_token_split(2, measured((1.728, 2.257, 4.11), ((4352, 1.592), (5376, 1.837)))) == (0, 4352)
    assert lone_token_split(2, measured((1.728, 2.257), ((4352, 1.70),))) == (0, 0)


def test_equal_gpu_times_are_split_exactly_in_one_pass():
    # A prefill's copy runs price every copy's compute alike (0): the one-pass split must be the optimum.
    rng = random.Random(11)
    for _ in range(150):
        loads, table, busy = random_case(rng, rng.randint(1, 10), rng.randint(1, 12))
        g = rng.choice([0.0, rng.uniform(0, 3)])
        model = _with_call(replace(table, gpu_ms=lambda n, g=g: g), rng.choice([0.0, rng.uniform(0, 3)]))
        got = assign_offloaded(loads, model, busy, exact_limit=0)  # no search: the one-pass split is taken anyway
        assert got.method == "exact"
        assert got.makespan_ms == pytest.approx(brute_force(loads, model, busy, all_orders=False), abs=1e-9)
        assert (got.cpu_finish_ms, got.gpu_finish_ms) == tuple(map(pytest.approx, finish_times(loads, got.copy, model, busy)))


def test_a_prefills_many_loads_in_copy_runs_split_no_worse_than_the_greedy_search():
    from moedesk.engine.offload.assignment import _greedy, _group, mean_load

    rng = random.Random(12)
    for _ in range(20):
        loads, table, busy = random_case(rng, 60, 200)
        model = _with_call(table, rng.uniform(0, 3), rng.uniform(0, 0.5))
        got = assign_offloaded(loads, model, busy, overlap=True, grouped_copies=True)
        contended = Contended(model, mean_load(loads), overlap=True, grouped_copies=True)
        groups = _group(loads, contended, busy, mean_load(loads))
        greedy = groups.makespan(_greedy(groups, [0] * len(groups.ids)))
        assert got.method == "exact" and got.makespan_ms <= greedy + 1e-9
