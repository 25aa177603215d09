"""tests/perf/bench_cpu_quant.py's calls: the uneven loads it times beside even ones, and the turns it takes."""
from __future__ import annotations

import torch

from tests.perf import bench_cpu_quant as bench


def test_uneven_loads_keep_the_tokens_and_stay_within_four_times_the_mean():
    gen = torch.Generator().manual_seed(3)
    for per_call, T in ((40, 3), (8, 4), (5, 1)):
        loads = bench.uneven_loads(per_call, T, gen)
        assert len(loads) == per_call and sum(loads) == per_call * T
        assert min(loads) >= 1 and max(loads) <= 4 * T
    skewed = bench.uneven_loads(40, 3, gen)
    assert max(skewed) >= 6 and skewed.count(1) >= 10  # a few take several shares, many keep their one


def test_a_call_list_mixes_even_and_uneven_calls_and_no_two_in_a_row_share_an_expert():
    gen = torch.Generator().manual_seed(0)
    flags = [False, True, True, False, True, False]
    calls = bench.calls_for(64, 8, 3, 32, len(flags), gen, uneven=flags)
    experts = [set(pe.tolist()) for _, pe in calls]
    for (x, pe), flag in zip(calls, flags):
        counts = torch.bincount(pe).tolist()
        assert x.shape == (24, 32) and pe.numel() == 24
        assert (sorted(c for c in counts if c) == [3] * 8) != flag
    assert all(not (a & b) for a, b in zip(experts, experts[1:]))


def test_variants_take_turns_in_a_rotating_order_on_calls_made_in_that_order(monkeypatch):
    monkeypatch.setattr(bench.cq, "use_library", lambda lib: ran.append(lib))
    ran, seen = [], []
    variants = {"a": ("lib a", False), "b": ("lib b", True)}
    asked = []

    def make_calls(flags):
        asked.extend(flags)
        return [(i,) for i in range(len(flags))]

    sec = bench.timed_builds(variants, lambda i: seen.append(i), make_calls, rounds=3, warmup=1)
    assert ran == ["lib b", "lib a", "lib a", "lib b", "lib b", "lib a", "lib a", "lib b"]
    assert asked == [lib == "lib b" for lib in ran] and seen == list(range(8))
    assert set(sec) == {"a", "b"}
