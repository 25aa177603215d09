"""The profiler's CPU timings read experts from RAM as a step does, not one expert again and again from a cache."""
import torch

from engine.offload import profiler
from kernels.expert_weights import ExpertWeights


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
    points = profiler.profile_expert(_stack(3), "cpu", cpu_tokens=(1, 4), gpu_tokens=(1,), repeat=3)
    assert set(points["cpu_expert_ms"]) == {1, 4} and points["expert_bytes"] == 3 * 16 * 8 * 4
    # Per token count: a warm-up and three timed calls, each on one expert, the next one each time.
    assert calls == [[0], [1], [2], [0], [0] * 4, [1] * 4, [2] * 4, [0] * 4]


def test_a_call_can_take_several_experts_at_a_time(monkeypatch):
    calls = _recording(monkeypatch)
    w = _stack(3)
    call = profiler._taking_turns(w, torch.randn(4, 16), torch.empty(4, 16), group=2)
    for _ in range(3):
        call()
    assert calls == [[0, 0, 1, 1], [2, 2, 0, 0], [0, 0, 1, 1]]
