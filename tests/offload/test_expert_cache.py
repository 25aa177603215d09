"""The GPU expert cache's decisions (engine.offload.expert_cache) and the routing traces they are measured on
(engine.offload.routing_trace): pure functions, no GPU."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.expert_cache import (CachePolicy, ExpertCache, Swap, SwapPrice, hits_launched, replay,
                                                  swap_gain)
from moedesk.engine.offload.placement import plan_placement
from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceParams, TraceShape, read_trace,
                                                  step_counts, synthetic_trace, write_trace)


def counts(layers, experts, picks):
    c = np.zeros((layers, experts), dtype=int)
    for layer, expert, n in picks:
        c[layer, expert] += n
    return c


def test_a_newcomer_used_more_than_margin_times_a_resident_takes_its_slot():
    resident = np.array([[True, False, False, False]])
    cache = ExpertCache(resident, CachePolicy(half_life=1e9, margin=2.0, min_score=1.0))
    assert cache.observe(counts(1, 4, [(0, 0, 2), (0, 1, 3)])) == []  # 3 < 2 x 2: stays
    assert cache.observe(counts(1, 4, [(0, 1, 2)])) == [Swap(0, 0, 1)]  # 5 > 2 x 2
    assert cache.resident.tolist() == [[False, True, False, False]]


def test_hysteresis_keeps_two_equally_used_experts_from_trading_places():
    cache = ExpertCache(np.array([[True, False]]), CachePolicy(half_life=4, margin=1.5))
    for step in range(200):  # alternate strictly: equal use, never 1.5x apart for long
        cache.observe(counts(1, 2, [(0, step % 2, 1)]))
    assert cache.swaps == 0


def test_without_a_margin_the_same_routing_thrashes():
    cache = ExpertCache(np.array([[True, False]]), CachePolicy(half_life=1, margin=1.0))
    for step in range(200):
        cache.observe(counts(1, 2, [(0, step % 2, 1)]))
    assert cache.swaps > 50  # what the margin above prevents


def test_swaps_per_step_bounds_the_copies_and_the_strongest_go_first():
    resident = np.array([[True, True, False, False], [True, False, False, False]])
    cache = ExpertCache(resident, CachePolicy(half_life=1e9, margin=1.0, swaps_per_step=2))
    swaps = cache.observe(counts(2, 4, [(0, 2, 5), (0, 3, 9), (1, 1, 7), (1, 2, 1)]))
    assert swaps == [Swap(0, 0, 3), Swap(1, 0, 1)]  # gains 9, 7 beat 5
    assert cache.resident.sum() == resident.sum()  # a swap never changes how many experts are resident


def test_layers_wholly_on_or_off_the_gpu_never_change():
    resident = np.array([[True, True], [False, False]])
    cache = ExpertCache(resident, CachePolicy(margin=1.0))
    for _ in range(10):
        assert cache.observe(counts(2, 2, [(1, 0, 5), (1, 1, 5)])) == []
    assert cache.resident.tolist() == resident.tolist()


def test_a_priced_swap_happens_only_where_its_saving_pays_the_copy():
    # 20 selections against none, noise sqrt(20 / 2) ~ 3.2 (no decay): 16.8 selections of 1 ms saved per copy.
    step = counts(1, 2, [(0, 1, 20)])
    policy = CachePolicy(half_life=1e9, copy_ms_per_step=20.0)
    costly = ExpertCache(np.array([[True, False]]), policy, price=SwapPrice(1.0, 17.5, 1.0))
    assert costly.observe(step) == []
    cheap = ExpertCache(np.array([[True, False]]), policy, price=SwapPrice(1.0, 16.0, 1.0))
    assert cheap.observe(step) == [Swap(0, 0, 1)]
    gain = swap_gain(np.array([20.0]), np.array([0.0]), CachePolicy(half_life=1e9), SwapPrice(1.0, 10.0))
    assert gain[0] == pytest.approx(20 - 2 * np.sqrt(10) - 10)  # two sigmas by default


def test_priced_experts_used_alike_never_trade_places_even_with_free_copies():
    cache = ExpertCache(np.array([[True, False]]), CachePolicy(half_life=4), price=SwapPrice(1.0, 0.0))
    for step in range(200):
        cache.observe(counts(1, 2, [(0, step % 2, 1)]))
    assert cache.swaps == 0


def test_priced_a_round_makes_the_copies_its_time_budget_pays_for():
    policy = CachePolicy(interval=16, copy_ms_per_step=1.0)
    resident = np.zeros((2, 8), dtype=bool)
    resident[:, 0] = True
    assert ExpertCache(resident, policy, price=SwapPrice(0.8, 2.5)).swap_budget() == 6  # Mixtral-sized experts
    assert ExpertCache(resident, policy, price=SwapPrice(0.03, 0.08)).swap_budget() == 200  # Qwen3-sized
    assert ExpertCache(resident, policy).swap_budget() == 64  # unpriced: swaps_per_step
    every_step = ExpertCache(resident, CachePolicy(interval=1), price=SwapPrice(0.8, 2.5))
    assert [every_step.swap_budget() for _ in range(3)] == [0, 0, 1]  # a copy bigger than a step's time: every 3rd


def test_priced_copies_spent_are_paid_for_again_before_the_next():
    resident = np.array([[True] + [False] * 6])
    cache = ExpertCache(resident, CachePolicy(half_life=1e9), price=SwapPrice(1.0, 2.0, 0.0))
    # Each step a new expert, used twice as much as the one before: every round has a swap that pays.
    moves = [len(cache.observe(counts(1, 7, [(0, 1 + step, 1000 * 2**step)]))) for step in range(6)]
    assert moves == [0, 1, 0, 1, 0, 1]  # 1 ms a step, 2 ms a copy


def test_old_use_decays():
    cache = ExpertCache(np.array([[True, False, False]]), CachePolicy(half_life=2, margin=1.2))
    cache.observe(counts(1, 3, [(0, 1, 8)]))  # 1 is admitted at once (0 had no use)
    assert cache.resident.tolist() == [[False, True, False]]
    for _ in range(10):
        cache.observe(counts(1, 3, [(0, 2, 1)]))  # 1's 8 halves every 2 steps; 2's steady use overtakes it
    assert cache.resident.tolist() == [[False, False, True]]


def test_hit_rate_counts_what_was_resident_when_the_step_ran():
    cache = ExpertCache(np.array([[True, False]]), CachePolicy(margin=1.0))
    cache.observe(counts(1, 2, [(0, 1, 4)]))  # a miss; 1 admitted after the step
    cache.observe(counts(1, 2, [(0, 1, 4)]))  # a hit
    assert cache.hit_rate == pytest.approx(0.5)


def test_policy_checks_its_fields():
    with pytest.raises(ValueError):
        CachePolicy(margin=0.5)


# Routing traces


def test_a_trace_reads_back_as_written(tmp_path):
    shape = TraceShape(layers=3, experts=16, top_k=2)
    steps = list(synthetic_trace(shape, 20, CONVERSATION, tokens=3, seed=1))
    path = tmp_path / "t.jsonl"
    write_trace(path, shape, steps)
    got_shape, got = read_trace(path)
    assert got_shape == shape and len(got) == 20
    assert all(np.array_equal(a, b) for s, t in zip(steps, got) for a, b in zip(s, t))


@pytest.mark.parametrize("text, where", [
    ("", "empty"),
    ('{"format": "other"}\n', "line 1"),
    ('{"format": "moedesk-routing-trace", "version": 1, "layers": 1, "experts": 4, "top_k": 2}\n{"experts": [[0, 9]]}\n',
     "line 2"),
    ('{"format": "moedesk-routing-trace", "version": 1, "layers": 2, "experts": 4, "top_k": 2}\n{"experts": [[0, 1]]}\n',
     "line 2"),
    ('{"format": "moedesk-routing-trace", "version": 1, "layers": 1, "experts": 4, "top_k": 2}\n' + "[" * 100000,
     "line 2"),
])
def test_a_bad_trace_is_one_line_naming_where(tmp_path, text, where):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(MoedeskError, match=where):
        read_trace(path)


def test_every_token_chooses_top_k_distinct_experts():
    shape = TraceShape(2, 8, 3)
    for step in synthetic_trace(shape, 50, TraceParams(skew=1.0, reuse=0.9, window=2), tokens=2, seed=3):
        for ids in step:
            assert len(ids) == 6 and all(len(set(ids[t:t + 3])) == 3 for t in (0, 3))


def lru_hit_rate(steps, capacity):
    hits = total = 0
    caches = [OrderedDict() for _ in steps[0]]
    for step in steps:
        for cache, ids in zip(caches, step):
            for e in ids.tolist():
                total += 1
                if e in cache:
                    hits += 1
                    cache.move_to_end(e)
                else:
                    cache[e] = True
                    if len(cache) > capacity:
                        cache.popitem(last=False)
    return hits / total


def static_coverage(steps, experts, top):
    """A top-`top` list per layer learned on the first half of the steps: its share of the second half's."""
    half = len(steps) // 2
    first = sum(step_counts(s, experts) for s in steps[:half])
    second = sum(step_counts(s, experts) for s in steps[half:])
    best = np.argsort(-first, axis=1)[:, :top]
    return float(np.mean(np.take_along_axis(second, best, axis=1).sum(axis=1) / second.sum(axis=1)))


def test_the_conversation_preset_has_the_locality_reported_for_a_512_expert_model():
    # docs/expert-cache.md: 512 experts, 10 per token; a per-layer LRU of 64 hits ~67%, of 128 ~81%; a static
    # top-32 learned on half of the routing covers ~10% of the other half (6.2% if spread evenly).
    steps = list(synthetic_trace(TraceShape(2, 512, 10), 1500, CONVERSATION, seed=1))
    assert 0.60 < lru_hit_rate(steps, 64) < 0.74
    assert 0.76 < lru_hit_rate(steps, 128) < 0.90
    assert 0.07 < static_coverage(steps, 512, 32) < 0.14


def test_no_locality_means_recent_use_predicts_nothing():
    steps = list(synthetic_trace(TraceShape(2, 512, 10), 600, NO_LOCALITY, seed=1))
    assert lru_hit_rate(steps, 64) == pytest.approx(64 / 512, abs=0.03)


def compare(params, shape, share, steps=800, price=None):
    """(fixed placement's hit rate, the cache's) on one conversation, the placement planned from another."""
    e = shape.experts
    calibration = sum(step_counts(s, e) for s in synthetic_trace(shape, 300, params, seed=99))
    fits = int(share * shape.layers * e)
    on_gpu = plan_placement(1, shape.layers, e, calibration, fits, 0).on_gpu
    trace = [step_counts(s, e) for s in synthetic_trace(shape, steps, params, seed=5)]
    return replay(trace, on_gpu, None), replay(trace, on_gpu, CachePolicy(), price)


def test_the_cache_follows_a_conversation_that_a_fixed_placement_cannot():
    fixed, cached = compare(CONVERSATION, TraceShape(4, 128, 8), 0.25)
    assert cached.hit_rate > 1.4 * fixed.hit_rate
    assert cached.swaps_per_step <= CachePolicy().swaps_per_step


def test_without_locality_the_cache_stays_near_the_fixed_placement_and_rarely_swaps():
    fixed, cached = compare(NO_LOCALITY, TraceShape(4, 128, 8), 0.25)
    assert cached.hit_rate >= 0.98 * fixed.hit_rate
    assert cached.swaps_per_step < 3


# Prices as the H200 box's profile gives them (RAM read ~118 GB/s, PCIe ~40 GB/s): a Q4_K expert of Qwen3-30B-A3B
# (2.65 MB) and of Mixtral-8x7B (99 MB), one token on the CPU against one copy.
QWEN3_PRICE, MIXTRAL_PRICE = SwapPrice(0.03, 0.08), SwapPrice(0.84, 2.5)


def test_priced_the_cache_still_follows_a_conversation():
    fixed, cached = compare(CONVERSATION, TraceShape(4, 128, 8), 0.36, price=QWEN3_PRICE)
    assert cached.hit_rate > 1.15 * fixed.hit_rate
    trace = [step_counts(s, 8) for s in synthetic_trace(TraceShape(2, 8, 2), 50, CONVERSATION)]
    assert replay(trace, np.eye(2, 8, dtype=bool), None, MIXTRAL_PRICE).swaps == 0  # no policy: fixed, priced or not


@pytest.mark.parametrize("shape, share, price", [(TraceShape(4, 128, 8), 0.36, QWEN3_PRICE),
                                                 (TraceShape(8, 8, 2), 0.5, MIXTRAL_PRICE)])
def test_priced_without_locality_next_to_no_swaps(shape, share, price):
    fixed, cached = compare(NO_LOCALITY, shape, share, price=price)
    assert cached.hit_rate >= 0.99 * fixed.hit_rate
    assert cached.swaps_per_step < 0.1  # unpriced: 2.7 and 0.19 a step


# The executor following the routing (the GPU tier simulated on the CPU, as in tests/offload/test_orchestration.py)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_an_engine_whose_experts_follow_the_routing_matches_transformers(arch, tiny_checkpoint, tmp_path, monkeypatch):
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine
    from tests.reference import hf_greedy, hf_model

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoint(arch)
    probe = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    prompts = [probe.tokenizer.encode(p) for p in ("Hi", "The quick brown fox jumps over the lazy", "def f(x):")]
    eos = probe.tokenizer.eos_token_ids | set(probe.config.eos_token_ids)
    expected = [hf_greedy(hf_model(folder), p, greedy.max_new_tokens, eos) for p in prompts]
    total = sum(map(len, probe.expert_map()[0]))
    monkeypatch.setenv("MOEDESK_EXPERT_CACHE", "1")
    engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True,
                         gpu_budget=probe.gpu_budget_for_experts(total // 4))
    assert engine.executor.cache is not None
    before = [row[:] for row in engine.expert_map()[0]]
    done = [next(engine.generate([Request(p, greedy)], 1)) for p in prompts]  # one at a time: many steps
    assert [c.token_ids for c in done] == expected
    stats = engine.expert_stats()
    assert stats["expert_swaps"] > 0 and engine.expert_map()[0] != before  # the residents moved ...
    assert sum(map(sum, engine.expert_map()[0])) == sum(map(sum, before))  # ... within the same budget


def test_policy_from_the_environment():
    from moedesk.engine.offload.expert_cache import policy_from_env

    assert policy_from_env(None) is None and policy_from_env("0") is None
    assert policy_from_env("1") == CachePolicy() and policy_from_env("16").interval == 16
    with pytest.raises(ValueError, match="MOEDESK_EXPERT_CACHE"):
        policy_from_env("yes")


def test_a_trace_router_gives_each_layer_its_ids_step_by_step():
    import torch

    from moedesk.engine.offload.routing_trace import TraceRouter

    steps = [[np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])], [np.array([1, 0, 3, 2]), np.array([5, 4, 7, 6])]]
    router = TraceRouter(steps, layers=[3, 7], top_k=2)
    like = torch.zeros((3, 2), dtype=torch.int64)
    assert router.step == -1
    assert router.ids(3, like).tolist() == [[0, 1], [2, 3], [0, 1]]  # the trace's two tokens, repeated to three
    assert router.ids(7, like).tolist() == [[4, 5], [6, 7], [4, 5]]
    assert router.ids(3, like[:1]).tolist() == [[1, 0]]  # the first layer again: the next step, cut to one token
    assert router.ids(7, like[:1]).tolist() == [[5, 4]]
    assert router.ids(3, like[:1]).tolist() == [[0, 1]]  # past the end: from the start
    assert router.step == 2
    with pytest.raises(MoedeskError, match="top-2"):
        router.ids(7, torch.zeros((1, 3), dtype=torch.int64))
    with pytest.raises(MoedeskError, match="before the first MoE layer"):
        router.ids(7, torch.zeros((2, 2), dtype=torch.int64))  # a token count the first layer has not routed
    with pytest.raises(MoedeskError, match="MoE layers"):
        TraceRouter(steps, layers=[0, 1, 2], top_k=2)
    with pytest.raises(MoedeskError, match="step 2 has no ids for MoE layer 1"):
        TraceRouter([steps[0], [np.array([], dtype=np.int64), steps[1][1]]], layers=[3, 7], top_k=2)


def test_a_trace_router_steps_on_the_device_alone_as_a_graph_replays_it():
    """What a CUDA graph captured over the router replays: the first MoE layer's routing, device work alone,
    refills the one buffer every layer's ids were handed from, so layers whose Python never runs again (a replay)
    read each later step's ids, equal to np.resize of the trace's (ragged steps, a prefill's many tokens, then one)."""
    import torch

    from moedesk.engine.offload.routing_trace import TraceRouter

    rng = np.random.default_rng(0)
    steps = [[rng.integers(0, 16, size=2 * int(rng.integers(1, 4))) for _ in range(3)] for _ in range(5)]
    router = TraceRouter(steps, layers=[1, 4, 6], top_k=2)
    with torch.inference_mode():  # as the model's forward runs it
        prefill = [router.ids(layer, torch.zeros((7, 2), dtype=torch.int64)) for layer in (1, 4, 6)]
    assert [ids.tolist() for ids in prefill] == [np.resize(steps[0][r], 14).reshape(7, 2).tolist() for r in range(3)]
    captured = [router.ids(layer, torch.zeros((1, 2), dtype=torch.int64)) for layer in (1, 4, 6)]  # "the capture"
    for position in range(2, 12):
        first = router.ids(1, torch.zeros((1, 2), dtype=torch.int64))  # all the replay runs of the router
        assert first.data_ptr() == captured[0].data_ptr()
        step = steps[position % len(steps)]
        assert [ids.tolist() for ids in captured] == [[list(step[r][:2])] for r in range(3)]
    assert router.step == 11


def test_replace_router_swaps_the_ids_and_keeps_the_weights_until_undone():
    import torch

    from moedesk.engine.offload.routing_trace import TraceRouter, replace_router

    class Block:
        def __init__(self, layer):
            self.layer = layer

        def route(self, x):
            return torch.ones((len(x), 2)), torch.zeros((len(x), 2), dtype=torch.int64)

    class Model:
        blocks = [Block(1), Block(2)]

        def moe_blocks(self):
            return self.blocks

    model = Model()
    steps = [[np.array([3, 4]), np.array([5, 6])]]
    replace_router(model, TraceRouter(steps, layers=[1, 2], top_k=2))
    w1, ids1 = model.blocks[0].route(torch.zeros((1, 8)))
    w2, ids2 = model.blocks[1].route(torch.zeros((1, 8)))
    assert ids1.tolist() == [[3, 4]] and ids2.tolist() == [[5, 6]] and w1.tolist() == [[1.0, 1.0]]
    replace_router(model, None)
    assert model.blocks[0].route(torch.zeros((1, 8)))[1].tolist() == [[0, 0]]


# Where a hit saves nothing: a partly resident layer whose few hits a step the executor computes on the CPU, as
# cheaper than launching them (assignment.resident_on_cpu). Prices of the H200 box's Qwen3-30B-A3B Q4_K profile
# (session 37: one expert at one token 0.0735 ms, a copy 0.0617 ms and its launch 0.19) and a resident launch of 0.47.
QWEN3_BOX = SwapPrice(0.0735, 0.0617 + 0.19, resident_launch_ms=0.47)


def test_hits_count_only_where_the_gpu_share_is_launched():
    price = SwapPrice(0.1, 1.0, resident_launch_ms=0.5)
    assert hits_launched(np.array([4.0, 5.0, 6.0]), price).tolist() == [False, True, True]
    assert hits_launched(np.array([0.0, 1.0]), replace(price, resident_launch_ms=0.0)).all()


def test_a_layer_s_hits_a_step_are_read_from_its_scores_from_the_first_step_on():
    # After the swap the layer's resident expert would get 4 hits a step (at 0.1 ms: short of a 0.5 ms launch) or 6
    # (clear of it): from the first step, decay or not.
    price = SwapPrice(0.1, 0.0, noise_sigmas=0.0, resident_launch_ms=0.5)
    for half_life in (4.0, 1e9):
        for newcomer_hits, swaps in ((4, 0), (6, 1)):
            cache = ExpertCache(np.array([[True, False, False]]), CachePolicy(half_life=half_life), price=price)
            step = counts(1, 3, [(0, 0, 1), (0, 1, 1), (0, 2, newcomer_hits)])
            assert len(cache.observe(step)) == swaps, (half_life, newcomer_hits)


def test_scores_carried_to_a_new_cache_keep_the_steps_they_hold():
    # One step's scores carried to a new cache (a new placement): read as one step's selections, the newcomer's 6
    # hits a step clear the 0.5 ms launch; read as the long run's (46 steps at a half-life of 32), a fraction of one.
    price = SwapPrice(0.1, 0.0, noise_sigmas=0.0, resident_launch_ms=0.5)
    on, step = np.array([[True, False, False]]), counts(1, 3, [(0, 0, 1), (0, 1, 1), (0, 2, 6)])
    first = ExpertCache(on, CachePolicy(interval=2), price=price)
    assert first.observe(step) == [] and first.score_steps == 1.0  # no round at its first step
    carried = ExpertCache(on, CachePolicy(), first.scores, price, score_steps=first.score_steps)
    assert carried.observe(step) == [Swap(0, 0, 2)]
    assert ExpertCache(on, CachePolicy(), first.scores, price).observe(step) == []


def test_a_new_placement_keeps_the_cache_s_scores_and_the_steps_they_hold():
    import torch

    from moedesk.engine.offload.offload_executor import OffloadExecutor
    from moedesk.kernels.expert_weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    stack = ExpertWeights(torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g), 8, 8)
    executor = OffloadExecutor({0: stack}, [[True, False, False, False]], "cpu", lambda loads: (sorted(loads), []))
    executor.follow_routing(CachePolicy(interval=1000), price=SwapPrice(0.1, 0.0, resident_launch_ms=0.5))
    for _ in range(3):
        executor.cache.observe(counts(1, 4, [(0, 1, 2), (0, 3, 1)]))
    scores, steps = executor.cache.scores.copy(), executor.cache.score_steps
    executor.set_placement([[False, True, False, False]])
    assert executor.cache is not None and executor.cache.resident.tolist() == [[False, True, False, False]]
    assert executor.cache.scores.tolist() == scores.tolist() and executor.cache.score_steps == steps < 3


def recorded_trace(tmp_path, shape, steps, tokens=1):
    """A CONVERSATION trace written as a routing-trace file and read back: what the bench replays."""
    path = tmp_path / "trace.jsonl"
    write_trace(path, shape, synthetic_trace(shape, steps, CONVERSATION, tokens=tokens, seed=5))
    return [step_counts(s, shape.experts) for s in read_trace(path)[1]]


def partly_resident(layers, experts, slots):
    on = np.zeros((layers, experts), dtype=bool)
    on[:, :slots] = True
    return on


def test_no_swaps_into_layers_whose_hits_the_cpu_takes_anyway(tmp_path):
    # Qwen3's shape at one token a step: 32 of 128 resident, about 2 hits a step, 0.15 ms on the CPU < a 0.47 launch.
    trace = recorded_trace(tmp_path, TraceShape(4, 128, 8), 96)
    on = partly_resident(4, 128, 32)
    policy = CachePolicy(copy_ms_per_step=20.0)
    assert replay(trace, on, policy, QWEN3_BOX).swaps == 0
    # The same decisions without the launch (the price before session 37): dozens of copies that buy nothing.
    assert replay(trace, on, policy, replace(QWEN3_BOX, resident_launch_ms=0.0)).swaps > 20


def test_swaps_resume_where_enough_hits_a_step_pay_the_launch(tmp_path):
    # 16 tokens a step (a batch): the same layers' resident experts get ~30 selections a step, worth the launch.
    trace = recorded_trace(tmp_path, TraceShape(4, 128, 8), 48, tokens=16)
    assert replay(trace, partly_resident(4, 128, 32), CachePolicy(copy_ms_per_step=20.0), QWEN3_BOX).swaps > 0


def test_mixtral_sized_hits_pay_the_launch_alone():
    # One 99 MB expert's selection (0.93 ms on the CPU) outweighs the launch (0.22 ms): the rule changes nothing.
    price = SwapPrice(0.93, 2.0, resident_launch_ms=0.22)
    cache = ExpertCache(np.array([[True, False] + [False] * 6]), CachePolicy(half_life=1e9, copy_ms_per_step=20.0),
                        price=price)
    assert cache.observe(counts(1, 8, [(0, 1, 10)])) == [Swap(0, 0, 1)]


# Recording a model's routing as a trace: what a real conversation's locality is read from.

def test_a_recorder_writes_each_step_s_ids_per_layer_in_token_order(tmp_path):
    import torch

    from moedesk.engine.offload.routing_trace import TraceRecorder, record_routing

    class Block:
        def __init__(self, layer, ids):
            self.layer, self.fixed = layer, ids

        def route(self, x):
            return torch.ones((len(x), 2)), self.fixed[:len(x)]

    class Model:
        blocks = [Block(3, torch.tensor([[0, 1], [2, 3], [1, 2]])), Block(5, torch.tensor([[4, 5], [0, 5], [3, 4]]))]

        def moe_blocks(self):
            return self.blocks

    model, path = Model(), tmp_path / "recorded.jsonl"
    recorder = TraceRecorder(path, layers=[3, 5], experts=6, top_k=2)
    record_routing(model, recorder)
    for tokens in (3, 1, 1):  # a prefill of 3 tokens, then two decode steps
        for block in model.blocks:
            assert block.route(torch.zeros((tokens, 4)))[0].shape == (tokens, 2)
    record_routing(model, None)
    recorder.close()
    shape, steps = read_trace(path)
    assert (shape.layers, shape.experts, shape.top_k) == (2, 6, 2)
    assert [[ids.tolist() for ids in step] for step in steps] == [
        [[0, 1, 2, 3, 1, 2], [4, 5, 0, 5, 3, 4]], [[0, 1], [4, 5]], [[0, 1], [4, 5]]]
    model.blocks[0].route(torch.zeros((1, 4)))  # unwrapped: nothing more recorded
    assert recorder.steps == 3


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_recorded_routing_is_the_one_transformers_chooses(arch, tiny_checkpoint, tmp_path, monkeypatch):
    import torch

    from moedesk.engine.offload.routing_trace import TraceRecorder, record_routing
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine
    from tests.reference import hf_model

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    blocks = engine.model.moe_blocks()
    recorder = TraceRecorder(tmp_path / "t.jsonl", [b.layer for b in blocks], engine.config.num_experts,
                             engine.config.num_experts_per_tok)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    record_routing(engine.model, recorder)
    try:
        done = next(engine.generate([Request(prompt, SamplingParams(max_new_tokens=6, temperature=0))], 1))
    finally:
        record_routing(engine.model, None)
        recorder.close()
    _, steps = read_trace(tmp_path / "t.jsonl")
    tokens = prompt + done.token_ids[:-1]  # every token the model ran: the last one generated is never fed back
    k = engine.config.num_experts_per_tok
    ours = [np.concatenate([step[i] for step in steps]).reshape(-1, k) for i in range(len(blocks))]
    with torch.no_grad():
        out = hf_model(folder)(torch.tensor([tokens]), output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        theirs = torch.topk(logits.reshape(len(tokens), -1), k).indices.sort(dim=1).values
        assert np.sort(ours[layer], axis=1).tolist() == theirs.tolist(), layer


def _one_mixed_layer_executor():
    import torch

    from moedesk.engine.offload.offload_executor import OffloadExecutor
    from moedesk.kernels.expert_weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    stack = ExpertWeights(torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g), 8, 8)
    executor = OffloadExecutor({0: stack}, [[True, False, False, False]], "cpu", lambda loads: (sorted(loads), []))
    executor.follow_routing(CachePolicy(interval=1))  # unpriced: expert 1's selections beat the idle resident 0
    return executor


def test_swaps_decided_in_a_handed_over_step_wait_for_the_next_forward():
    # The host's side of a handed-over step (`_host_tally`) runs while the step's graph waits for it: a swap made
    # there reads new slot maps onto the device behind that graph, which hung the bench on the GPU (session 39).
    executor = _one_mixed_layer_executor()
    version = executor.placement_version
    for _ in range(2):  # the second step's first count ends the first step, whose routing chose expert 1 thrice
        executor._host_tally(0, np.array([1, 1, 1]), 0, False, np.array([False, True, True, True]), 0.0, 0.0)
    assert executor.cache.resident.tolist() == [[False, True, False, False]]  # decided
    assert executor.on_gpu() == [[True, False, False, False]] and executor.placement_version == version  # not made
    executor.settle()  # what the graphs' next forward does first
    assert executor.on_gpu() == [[False, True, False, False]]
    assert executor.placement_version == version  # rewritten in place: the captured graphs stay valid
    assert executor.stats.swaps == 1
    executor.settle()
    assert executor.stats.swaps == 1  # made once


def test_an_eager_step_makes_its_swaps_at_once_and_settles_a_handed_over_step_s():
    executor = _one_mixed_layer_executor()
    for _ in range(2):
        executor._count(0, np.array([0, 3, 0, 0]))
    assert executor.on_gpu() == [[False, True, False, False]]  # no graph waits on an eager step's host
    executor = _one_mixed_layer_executor()
    for _ in range(2):
        executor._count(0, np.array([0, 3, 0, 0]), handed_over=True)
    executor._count(0, np.array([0, 3, 0, 0]))  # an eager step next, with no forward between to settle
    assert executor.on_gpu() == [[False, True, False, False]]
    executor.set_placement([[True, False, False, False]])  # a new placement drops what was decided against the old
    assert executor._unapplied == []


def test_the_graphs_forward_settles_the_executor_s_swaps_first():
    import torch

    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    executor = _one_mixed_layer_executor()
    for _ in range(2):
        executor._count(0, np.array([0, 3, 0, 0]), handed_over=True)
    graphs = GraphedDecode.__new__(GraphedDecode)  # only its start runs: graphs broken, the caller goes eager
    graphs.broken = "off"
    assert graphs.forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), executor) is None
    assert executor.on_gpu() == [[False, True, False, False]]


def _half_resident_executor(on_gpu):
    import torch

    from moedesk.engine.offload.offload_executor import OffloadExecutor
    from moedesk.kernels.expert_weights import ExpertWeights

    g = torch.Generator().manual_seed(1)
    stack = ExpertWeights(torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g), 8, 8)
    return OffloadExecutor({0: stack}, [on_gpu], "cpu", lambda loads: (sorted(loads), []))


def test_a_swap_rewrites_the_slot_maps_in_place_and_computes_what_a_fresh_placement_does():
    # Captured graphs read the device maps by address and a prepared host call the offloaded ids by pointer: a swap
    # must change their contents, not the objects, and leave placement_version (the graphs' key) alone.
    import torch
    from types import SimpleNamespace

    from moedesk.engine.offload.expert_executor import HostRouting

    executor = _half_resident_executor([True, True, False, False])
    before = executor._slots(0)
    pointers = [t.data_ptr() for t in before[:2]]
    version = executor.placement_version
    executor._unapplied = [Swap(0, 0, 2)]  # expert 2 into expert 0's slot
    executor.settle()
    after = executor._slots(0)
    assert all(a is b for a, b in zip(before, after)) and [t.data_ptr() for t in after[:2]] == pointers
    assert executor.placement_version == version and executor.stats.swaps == 1
    assert after[0].tolist() == [0, 1, 0, 0] and after[1].tolist() == [False, True, True, False]
    assert after[2].tolist() == [True, False, False, True] and after[3].tolist() == [0, 3]
    assert after[3].dtype == np.int64 and after[3].flags.c_contiguous  # what prepare_routed points into as it is
    fresh = _half_resident_executor([False, True, True, False])
    assert executor.on_gpu() == fresh.on_gpu()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=g)
    ids = torch.tensor([[0, 2], [1, 3], [2, 1]])
    moe = SimpleNamespace(layer=0)
    assert torch.equal(executor.expert_outputs(moe, x, ids), fresh.expert_outputs(moe, x, ids))
    (y, mask), (y_fresh, mask_fresh) = executor.device_share(moe, x, ids), fresh.device_share(moe, x, ids)
    assert torch.equal(mask, mask_fresh) and mask.tolist() == [False, True, True, False, True, True]
    torch.testing.assert_close(y[mask], y_fresh[mask])  # the same experts in other slots: groups of other sizes
    outs = []
    for one in (executor, fresh):
        out = torch.zeros(2, 8)
        one.host_share(moe, HostRouting(x[:1], torch.tensor([[0, 3]]), SimpleNamespace(synchronize=lambda: None)), out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum(dim=1).tolist()[0] > 0  # expert 0 now offloaded


def test_a_layer_s_kind_is_what_a_swap_keeps():
    from moedesk.engine.offload.offload_executor import _layer_kind

    assert _layer_kind([0, None, 1, None]) == _layer_kind([None, 1, 0, None]) == (2, 4)  # a swap within the layer
    assert _layer_kind([0, None, 1, None]) != _layer_kind([0, 2, 1, None])  # one more resident: graphs baked it in


def test_a_swap_is_priced_at_its_copy_s_bytes_alone():
    from types import SimpleNamespace

    costs = SimpleNamespace(cpu_expert_ms=lambda tokens: 0.8 * tokens, copy_expert_ms=1.8, copy_launch_ms=0.2,
                            resident_launch_ms=0.22)
    assert SwapPrice.from_model(costs) == SwapPrice(0.8, 1.8, resident_launch_ms=0.22)


def test_hits_in_a_handed_over_step_need_no_launch_to_pay():
    # Two selections a step at 0.1 ms: 0.2 ms on the CPU, less than the eager resident launch (0.5 ms), so eagerly the
    # CPU would take them and a swap buys nothing; handed over, the resident share runs in the graph, launched by none.
    price = SwapPrice(0.1, 0.0, noise_sigmas=0.0, resident_launch_ms=0.5)
    assert price.in_graph() == replace(price, resident_launch_ms=0.0)
    step = counts(1, 4, [(0, 1, 2)])
    eager = ExpertCache(np.array([[True, False, False, False]]), CachePolicy(half_life=1e9), price=price)
    assert eager.observe(step) == []
    graphed = ExpertCache(np.array([[True, False, False, False]]), CachePolicy(half_life=1e9), price=price)
    assert graphed.observe(step, in_graph=True) == [Swap(0, 0, 1)]


def test_the_executor_prices_a_handed_over_step_s_swaps_in_the_graph():
    executor = _one_mixed_layer_executor()
    executor.follow_routing(CachePolicy(half_life=1e9),
                            price=SwapPrice(0.1, 0.0, noise_sigmas=0.0, resident_launch_ms=0.5))
    offloaded = np.array([False, True, True, True])
    for _ in range(2):  # the second step's first count ends the first, whose expert 1 had two selections
        executor._count(0, np.array([0, 2, 0, 0]))
    assert executor.cache.swaps == 0  # eager: 0.2 ms of hits do not pay the 0.5 ms launch
    executor = _one_mixed_layer_executor()
    executor.follow_routing(CachePolicy(half_life=1e9),
                            price=SwapPrice(0.1, 0.0, noise_sigmas=0.0, resident_launch_ms=0.5))
    for _ in range(2):
        executor._host_tally(0, np.array([1, 1]), 0, False, offloaded, 0.0, 0.0)
    assert executor.cache.swaps == 1 and executor.cache.resident.tolist() == [[False, True, False, False]]
