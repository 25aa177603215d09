"""tests.pinned_profile: Engine.load takes the hand-written profile instead of measuring one, and it gives the
layout the GPU tests that pin it assert (tests/model/test_gpu_equivalence.py), whatever this machine measures."""
import pytest

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.pinned_profile import COPIES, HOST_ONLY, pin_profile


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_pinned_profile_sends_every_offloaded_expert_to_the_cpu_and_hands_batch_one_steps_over(
        arch, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    orchestra, executor = engine.orchestra, engine.executor
    assert orchestra.profile == HOST_ONLY and orchestra.profile is not HOST_ONLY
    assert not list(tmp_path.glob("profile-*.json"))  # neither measured nor cached
    top_k = engine.config.num_experts_per_tok
    layers = sorted(executor.banks)
    experts = len(executor.on_gpu()[0])

    # The decisions themselves: the CPU computes any load it is given, nothing is streamed from RAM, resident
    # experts stay on the GPU.
    for loads in ({e: 1 for e in range(top_k)}, {0: 3, 1: 40, 2: 1}, {e: 512 for e in range(experts)}):
        on_cpu, to_copy = executor.decide(loads)
        assert sorted(on_cpu) == sorted(loads) and not to_copy, loads
    assert executor.zero_copy_ranks(top_k) == 0 and executor.split_width(top_k) == 0
    assert executor.resident_to_cpu({0: 1, 1: 2}) == []

    # What engine.generation.cuda_graphs asks before handing a batch-1 step to the host, as on a GPU (the
    # simulated tier never hands over), with every expert in RAM and with half of each layer's resident.
    executor.simulated = False
    assert all(executor.host_only(layer, 1, top_k) for layer in layers)
    executor.set_placement([[e % 2 == 0 for e in range(len(row))] for row in executor.on_gpu()])
    assert all(executor.host_only(layer, 1, top_k) for layer in layers)
    executor.simulated = True

    # And the decode that follows: CPU and resident experts, no copy.
    executor.stats = type(executor.stats)()
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    [done] = engine.generate([Request(ids, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))], 1)
    assert len(done.token_ids) == 6
    stats = executor.stats
    assert stats.cpu_experts > 0 and stats.gpu_experts > 0 and stats.copied_experts == 0


def test_placement_under_the_pinned_profile_goes_by_popularity(tiny_checkpoint, tmp_path, monkeypatch):
    # No round trip and no launch cost: whole layers save nothing, so half the experts are the most popular half.
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    orchestra = engine.orchestra
    total = engine.expert_stats()["experts_total"]
    plan = orchestra.place(total // 2 * orchestra.expert_bytes)
    popularity = orchestra.popularity
    chosen = [popularity[l][e] for l, row in enumerate(plan.as_lists()) for e, on in enumerate(row) if on]
    left = [popularity[l][e] for l, row in enumerate(plan.as_lists()) for e, on in enumerate(row) if not on]
    assert len(chosen) == total // 2 and min(chosen) >= max(left)


def test_the_copies_profile_copies_every_offloaded_expert(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch, COPIES)
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    executor = engine.executor
    top_k = engine.config.num_experts_per_tok
    for loads in ({e: 1 for e in range(top_k)}, {0: 3, 1: 40, 2: 1}):
        on_cpu, to_copy = executor.decide(loads)
        assert not on_cpu and sorted(to_copy) == sorted(loads), loads
    assert executor.zero_copy_ranks(top_k) == 0 and executor.resident_to_cpu({0: 1, 1: 2}) == []
    executor.simulated = False
    assert not any(executor.host_only(layer, 1, top_k) for layer in executor.banks)


def test_a_lone_tokens_experts_stay_on_the_cpu_once_the_profile_measured_its_zero_copy(
        tiny_checkpoint, tmp_path, monkeypatch):
    """The copying machine again, but its profile timed a lone token's GPU options (streaming whole experts, no
    gain): the per-step rule leaves a lone token's experts on the CPU (assignment.lone_token_measured), so a batch-1
    step is handed to the host whole, where before every step copied; steps of more tokens still copy."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    top_k = 2  # the tiny Mixtral's
    pin_profile(monkeypatch, {**COPIES, "zero_copy_split_ms": {0: 1.0, 1: 1.2, 2: 1.5}, "zero_copy_top_k": top_k})
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    assert engine.config.num_experts_per_tok == top_k
    executor = engine.executor
    lone = {e: 1 for e in range(top_k)}
    assert executor.decide(lone) == (sorted(lone), [])
    on_cpu, to_copy = executor.decide({0: 3, 1: 40, 2: 1})
    assert not on_cpu and sorted(to_copy) == [0, 1, 2]
    assert executor.zero_copy_ranks(top_k) == 0 and executor.split_width(top_k) == 0  # nothing beat the CPU
    executor.simulated = False
    assert all(executor.host_only(layer, 1, top_k) for layer in executor.banks)
