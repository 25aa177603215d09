"""The profiler's CPU timings read experts from RAM as a step does, not one expert again and again from a cache."""
import torch

from moedesk.engine.offload import profiler
from moedesk.kernels.expert_weights import ExpertWeights


def _stack(experts: int, hidden: int = 16, width: int = 8) -> ExpertWeights:
    return ExpertWeights(torch.randn(experts, 2 * width, hidden), torch.randn(experts, hidden, width), hidden, width)


def _recording(monkeypatch) -> list[list[int]]:
    calls = []
    routed = profiler.experts_forward_routed

    def record(x, pair_expert, k, chosen, w, out, *rest, **kw):
        calls.append(pair_expert.tolist())
        return routed(x, pair_expert, k, chosen, w, out, *rest, **kw)

    monkeypatch.setattr(profiler, "experts_forward_routed", record)
    return calls


def test_cpu_times_take_the_stacks_experts_in_turn(monkeypatch):
    calls = _recording(monkeypatch)
    points = profiler.profile_expert(_stack(3), "cpu", cpu_tokens=(1, 32), gpu_tokens=(1,), repeat=3)
    assert set(points["cpu_expert_ms"]) == {1, 32} and points["expert_bytes"] == 3 * 16 * 8 * 4
    # Per token count: a warm-up and three timed calls, each on one expert, the next one each time; at a count of
    # decode's, then calls of all three experts (the stack has no more); 32 tokens an expert are not decode's.
    assert calls == [[0], [1], [2], [0], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2],
                     [0] * 32, [1] * 32, [2] * 32, [0] * 32]
    assert set(points["cpu_call_ms"]) == {1} and points["cpu_call_experts"] == 3


def test_calls_of_several_experts_take_the_stack_in_turn_too(monkeypatch):
    calls = _recording(monkeypatch)
    points = profiler.profile_expert(_stack(8), "cpu", cpu_tokens=(2,), gpu_tokens=(1,), repeat=3)
    one = [[e] * 2 for e in (0, 1, 2, 3)]
    four = [[e for e in range(first, first + 4) for _ in range(2)] for first in (0, 4, 0, 4)]
    assert calls == one + four
    assert points["cpu_call_experts"] == profiler.CALL_EXPERTS == 4 and set(points["cpu_call_ms"]) == {2}


def test_a_stack_of_one_expert_has_no_calls_of_several(monkeypatch):
    points = profiler.profile_expert(_stack(1), "cpu", cpu_tokens=(1,), gpu_tokens=(1,), repeat=1)
    assert "cpu_call_ms" not in points and "cpu_call_experts" not in points


def test_a_call_can_take_several_experts_at_a_time(monkeypatch):
    calls = _recording(monkeypatch)
    w = _stack(3)
    call = profiler._taking_turns(w, torch.randn(4, 16), torch.empty(4, 16), group=2)
    for _ in range(3):
        call()
    assert calls == [[0, 0, 1, 1], [2, 2, 0, 0], [0, 0, 1, 1]]


def test_prefill_calls_of_unpacked_experts_are_timed_on_their_one_path(monkeypatch):
    calls = _recording(monkeypatch)
    points = profiler.profile_prefill_cpu(_stack(8), torch.float32, tokens=(8, 16), experts=4, repeat=1)
    assert points["cpu_prefill_ms"].keys() == {"dense"} and points["cpu_path"] == "dense"
    assert set(points["cpu_prefill_ms"]["dense"]) == {8, 16} and points["cpu_prefill_experts"] == 4
    # A warm-up and one timed call per load, four experts of the stack in turn, 8 then 16 tokens each.
    assert calls == [[e for e in range(first, first + 4) for _ in range(n)] for n in (8, 16) for first in (0, 4)]
