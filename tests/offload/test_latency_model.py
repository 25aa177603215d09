"""The latency model: fits of CPU/GPU expert time, its JSON form, and its refusals."""
import json

import numpy as np
import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.latency_model import LatencyModel, ProfileError, fit_latency_model

MiB = 2**20
CPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def profile(cpu, gpu=None, **extra):
    """Raw measurements in the shape engine.offload.profiler.profile_expert returns."""
    points = {
        "cpu_expert_ms": {n: float(cpu(n)) for n in CPU_TOKENS},
        "gpu_expert_ms": gpu or {1: 0.17, 4: 0.18, 16: 0.2, 64: 0.25, 256: 0.32, 1024: 0.6, 4096: 2.1},
        "copy_expert_ms": 6.5, "activation_roundtrip_ms": 0.045,
        "threads": 16, "device": "cuda", "pinned": True,  # other keys are ignored
    }
    points.update(extra)
    return points


def test_affine_cpu_times_are_recovered():
    model = fit_latency_model(profile(lambda n: 2.0 + 0.1 * n))
    assert model.cpu_intercept_ms == pytest.approx(2.0) and model.cpu_per_token_ms == pytest.approx(0.1)
    for n in (1, 3, 100, 1000):
        assert model.cpu_expert_ms(n) == pytest.approx(2.0 + 0.1 * n)


def test_bandwidth_floor_then_linear_is_recovered_exactly():
    # 352 MiB at 102 GB/s is 3.62 ms; compute overtakes the read beyond ~70 tokens.
    floor = 352 * MiB / 102e6
    model = fit_latency_model(profile(lambda n: max(floor, 0.1 + 0.05 * n), expert_bytes=352 * MiB,
                                      cpu_read_gbs=102.0))
    assert model.cpu_floor_ms == pytest.approx(floor)
    for n in (1, 5, 16, 50, 70, 71, 90, 256, 400):
        assert model.cpu_expert_ms(n) == pytest.approx(max(floor, 0.1 + 0.05 * n))


def test_kernel_slower_than_the_read_bandwidth_sets_the_floor():
    # A bf16 kernel that reads at ~70% of the bandwidth, flat up to 16 tokens (docs/measurements.md): one
    # line through all points would be 20-40% off; the kernel's own floor makes it exact.
    model = fit_latency_model(profile(lambda n: max(5.0, 0.3 * n), expert_bytes=352 * MiB, cpu_read_gbs=102.0))
    for n in CPU_TOKENS + (3, 20, 300):
        assert model.cpu_expert_ms(n) == pytest.approx(max(5.0, 0.3 * n), rel=1e-6)


def test_cache_hot_profile_is_held_to_the_dram_read_time():
    # A small expert profiled in a loop sits in the last-level cache; a real step streams it from DRAM.
    floor = 9 * MiB / 50e6
    model = fit_latency_model(profile(lambda n: 0.02 + 0.004 * n, expert_bytes=9 * MiB, cpu_read_gbs=50.0))
    assert model.cpu_expert_ms(1) == pytest.approx(floor)
    assert model.cpu_expert_ms(256) == pytest.approx(max(floor, 0.02 + 0.004 * 256), rel=0.02)


def test_noisy_times_keep_small_loads_accurate():
    # Relative least squares: the 1-token point weighs as much as the 256-token one.
    rng = np.random.default_rng(0)
    noise = dict(zip(CPU_TOKENS, rng.uniform(0.97, 1.03, len(CPU_TOKENS))))
    model = fit_latency_model(profile(lambda n: (1.0 + 0.2 * n) * noise[n]))
    for n in CPU_TOKENS:
        assert model.cpu_expert_ms(n) == pytest.approx(1.0 + 0.2 * n, rel=0.06)


def test_cpu_time_never_falls_with_more_tokens():
    model = fit_latency_model(profile(lambda n: 6.0 - 0.001 * n))  # noise on a flat curve
    assert model.cpu_per_token_ms == 0.0
    times = [model.cpu_expert_ms(n) for n in range(1, 300)]
    assert times == sorted(times) and min(times) > 0


def test_gpu_points_are_interpolated_and_extended():
    model = fit_latency_model(profile(lambda n: 5.0, gpu={1: 0.2, 64: 0.25, 256: 0.5, 1024: 1.0}))
    assert model.gpu_expert_ms(1) == pytest.approx(0.2) and model.gpu_expert_ms(256) == pytest.approx(0.5)
    assert model.gpu_expert_ms(160) == pytest.approx(0.375)  # halfway between 64 and 256
    assert model.gpu_expert_ms(0.5) == pytest.approx(0.2)  # flat below the first point
    assert model.gpu_expert_ms(2048) == pytest.approx(1.0 + 0.5 / 768 * 1024)  # last slope continues


def test_gpu_dip_in_measurements_is_smoothed_out():
    model = fit_latency_model(profile(lambda n: 5.0, gpu={1: 0.3, 4: 0.2, 16: 0.35}))
    assert model.gpu_ms == (0.3, 0.3, 0.35)
    times = [model.gpu_expert_ms(n) for n in range(1, 40)]
    assert times == sorted(times)


def test_no_tokens_cost_nothing():
    model = fit_latency_model(profile(lambda n: 5.0))
    assert model.cpu_expert_ms(0) == model.gpu_expert_ms(0) == model.activation_roundtrip_ms(0) == 0.0


def test_copy_and_activation_round_trip():
    model = fit_latency_model(profile(lambda n: 5.0))
    assert model.copy_expert_ms == 6.5
    assert model.activation_roundtrip_ms(1) == model.activation_roundtrip_ms(64) == pytest.approx(0.045)
    scaled = fit_latency_model(profile(lambda n: 5.0, activation_roundtrip_ms={1: 0.05, 64: 0.1, 512: 0.5}))
    assert scaled.activation_roundtrip_ms(1) < scaled.activation_roundtrip_ms(64) < scaled.activation_roundtrip_ms(512)
    assert scaled.activation_roundtrip_ms(512) == pytest.approx(0.5, rel=0.1)
    assert fit_latency_model({k: v for k, v in profile(lambda n: 5.0).items()
                              if k != "activation_roundtrip_ms"}).activation_roundtrip_ms(8) == 0.0


def test_json_round_trip_gives_the_same_model():
    model = fit_latency_model(profile(lambda n: max(5.0, 0.3 * n), expert_bytes=352 * MiB, cpu_read_gbs=102.0))
    back = LatencyModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert back == model
    for n in (1, 7, 100, 5000):
        assert back.cpu_expert_ms(n) == model.cpu_expert_ms(n) and back.gpu_expert_ms(n) == model.gpu_expert_ms(n)


def test_measurements_read_back_from_json_fit_the_same():
    # JSON turns the token-count keys into strings.
    raw = profile(lambda n: 2.0 + 0.1 * n)
    assert fit_latency_model(json.loads(json.dumps(raw))) == fit_latency_model(raw)


@pytest.mark.parametrize("broken", [
    {"version": 99},
    {"version": 1, "cpu_intercept_ms": 1.0},  # fields missing
    {**LatencyModel(1.0, 0.1, 0.5, (1, 8), (0.2, 0.3), 6.5).to_dict(), "gpu_tokens": [8, 1]},
    {**LatencyModel(1.0, 0.1, 0.5, (1, 8), (0.2, 0.3), 6.5).to_dict(), "copy_expert_ms": -1.0},
    [1, 2, 3],
])
def test_a_damaged_cached_model_is_refused(broken):
    with pytest.raises(ProfileError):
        LatencyModel.from_dict(broken)


@pytest.mark.parametrize("drop, change", [
    ("cpu_expert_ms", None), ("gpu_expert_ms", None), ("copy_expert_ms", None),
    (None, {"cpu_expert_ms": {}}), (None, {"cpu_expert_ms": {1: 0.0}}), (None, {"gpu_expert_ms": {"x": 1.0}}),
])
def test_incomplete_measurements_are_refused(drop, change):
    raw = profile(lambda n: 5.0)
    raw.pop(drop, None)
    raw.update(change or {})
    with pytest.raises(ProfileError) as err:
        fit_latency_model(raw)
    assert isinstance(err.value, MoedeskError)


def test_contention_factors_are_read_clipped_at_one_and_kept_through_json():
    assert fit_latency_model(profile(lambda n: 5.0)).slowdowns(4) == (1.0, 1.0)  # none measured
    model = fit_latency_model(profile(lambda n: 5.0, cpu_slowdown_during_copy=1.7, copy_slowdown_during_cpu=0.96))
    assert model.slowdowns(1) == model.slowdowns(64) == (1.7, 1.0)  # one factor for all; a faster copy is noise
    assert LatencyModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_contention_by_tokens_is_interpolated_and_held_beyond_the_ends():
    # JSON's string keys, as a cached profile reads back.
    model = fit_latency_model(profile(lambda n: 5.0, cpu_slowdown_during_copy={"1": 1.9, "4": 1.1, "16": 0.98},
                                      copy_slowdown_during_cpu={"1": 1.2, "4": 1.1, "16": 1.0}))
    assert model.contention == ((1, 1.9, 1.2), (4, 1.1, 1.1), (16, 1.0, 1.0))
    assert model.slowdowns(1) == (1.9, 1.2) and model.slowdowns(0.5) == (1.9, 1.2)
    assert model.slowdowns(2.5) == (pytest.approx(1.5), pytest.approx(1.15))
    assert model.slowdowns(10) == (pytest.approx(1.05), pytest.approx(1.05))
    assert model.slowdowns(300) == (1.0, 1.0)
    assert LatencyModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


@pytest.mark.parametrize("bad", ["fast", -1.0, 0.0, float("nan"), {"1": 1.2, "x": 1.0}, {"0": 1.2}, {"1": -1.0}, {}])
def test_a_bad_contention_factor_is_refused(bad):
    with pytest.raises(ProfileError):
        fit_latency_model(profile(lambda n: 5.0, cpu_slowdown_during_copy=bad))


def test_contention_factors_must_share_their_token_counts():
    with pytest.raises(ProfileError, match="same token counts"):
        fit_latency_model(profile(lambda n: 5.0, cpu_slowdown_during_copy={1: 1.5, 4: 1.1},
                                  copy_slowdown_during_cpu={1: 1.2}))


def test_copy_launch_time_is_read_and_checked():
    assert fit_latency_model(profile(lambda n: 5.0)).copy_launch_ms == 0.0  # older profiles, simulated tier
    assert fit_latency_model(profile(lambda n: 5.0, copy_launch_ms=0.12)).copy_launch_ms == 0.12
    with pytest.raises(ProfileError):
        fit_latency_model(profile(lambda n: 5.0, copy_launch_ms=-0.1))


def test_zero_copy_split_is_read_and_checked():
    assert fit_latency_model(profile(lambda n: 5.0)).zero_copy_split_ms == ()  # not measured: no streaming
    # As JSON gives it back: string keys, in any order.
    model = fit_latency_model(profile(lambda n: 5.0, zero_copy_split_ms={"1": 0.5, "0": 0.7, "2": 0.6},
                                      zero_copy_top_k=8))
    assert model.zero_copy_split_ms == (0.7, 0.5, 0.6) and model.zero_copy_top_k == 8
    assert LatencyModel.from_dict(model.to_dict()) == model
    for bad in ({"0": 0.7, "2": 0.6}, {"0": -1.0}, {"0": float("nan")}, [0.7, 0.5]):
        with pytest.raises(ProfileError):
            fit_latency_model(profile(lambda n: 5.0, zero_copy_split_ms=bad, zero_copy_top_k=8))


def test_resident_launch_time_is_read_and_checked():
    assert fit_latency_model(profile(lambda n: 5.0)).resident_launch_ms == 0.0
    assert fit_latency_model(profile(lambda n: 5.0, resident_launch_ms=0.2)).resident_launch_ms == 0.2
    with pytest.raises(ProfileError):
        fit_latency_model(profile(lambda n: 5.0, resident_launch_ms=float("nan")))


def test_a_spike_at_few_tokens_is_capped_by_larger_counts():
    # Measured on the GPU box: one token slower than two (the first point taken), which would make
    # a step with one-token experts look a fifth slower on the CPU than it is.
    times = {1: 3.6, 2: 2.95, 4: 2.99, 8: 4.09, 16: 6.67, 32: 12.5, 64: 10.2, 128: 17.7, 256: 32.0}
    model = fit_latency_model(profile(lambda n: times[n], expert_bytes=352 * MiB, cpu_read_gbs=131.0))
    assert model.cpu_expert_ms(1) < 1.05 * 2.95


def _calls(share, own, experts=4, tokens=(1, 2, 4, 8, 16)):
    """A profile's one-expert calls (own + share) and calls of `experts` experts (own + experts * share)."""
    return profile(lambda n: own(n) + share(n),
                   cpu_call_ms={n: own(n) + experts * share(n) for n in tokens}, cpu_call_experts=experts)


def test_calls_of_several_experts_part_an_experts_share_from_the_calls_own_cost():
    # A Mixtral q4_0 expert on the GPU box: one in a call 1.16 ms at one token, two in one call 1.96.
    share, own = (lambda n: 0.70 + 0.1 * n), (lambda n: 0.36 if n == 1 else 0.3)
    model = fit_latency_model(_calls(share, own))
    for n in (1, 2, 4, 8, 16, 64, 256):
        assert model.cpu_expert_ms(n) == pytest.approx(share(n), rel=1e-6)
        assert model.cpu_alone_ms(n) == pytest.approx(share(n) + own(min(n, 16)), rel=1e-6)
    assert model.cpu_call_ms(1) == pytest.approx(0.36) and model.cpu_call_ms(1.5) == pytest.approx(0.33)
    assert model.cpu_call_ms(100) == pytest.approx(0.3)  # held past the last count measured in calls
    assert LatencyModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_without_calls_of_several_an_expert_costs_its_own_call():
    model = fit_latency_model(profile(lambda n: 1.16 + 0.02 * n))
    assert model.cpu_call == () and model.cpu_call_ms(4) == 0.0
    assert model.cpu_expert_ms(4) == model.cpu_alone_ms(4) == pytest.approx(1.24)


def test_an_experts_share_never_falls_below_reading_its_bytes():
    # Noise that makes four experts in a call look barely dearer than one: the share stays the bytes' read time.
    floor = 99 * MiB / 120e6
    raw = profile(lambda n: 1.2, expert_bytes=99 * MiB, cpu_read_gbs=120.0, cpu_call_ms={1: 1.3}, cpu_call_experts=4)
    model = fit_latency_model(raw)
    assert model.cpu_expert_ms(1) == pytest.approx(floor) and model.cpu_alone_ms(1) == pytest.approx(1.2)


@pytest.mark.parametrize("bad", [{"cpu_call_ms": {512: 3.0}}, {"cpu_call_ms": {1: -1.0}}, {"cpu_call_ms": {}}])
def test_calls_of_several_experts_that_do_not_fit_the_one_expert_calls_are_refused(bad):
    with pytest.raises(ProfileError):
        fit_latency_model(profile(lambda n: 1.0, cpu_call_experts=4, **bad))


def _prefill(cpu_line, shares, path="vnni", experts=8, **extra):
    """A profile whose one-expert calls follow cpu_line and whose calls of `experts` experts at prefill loads took
    experts * shares[n] on `path` (engine.offload.profiler.profile_prefill_cpu)."""
    return profile(cpu_line, cpu_prefill_ms={path: {n: experts * ms for n, ms in shares.items()}},
                   cpu_prefill_experts=experts, cpu_path=path, **extra)


def test_prefill_loads_are_priced_from_calls_of_several_experts_at_those_loads():
    # One-expert calls leave threads idle: their slope (0.03 ms a token) overprices a prefill step's experts,
    # whose share the calls of eight measured at 0.16 ms at 8 tokens up to 0.60 at 64.
    shares = {8: 0.16, 16: 0.2, 32: 0.33, 64: 0.6}
    model = fit_latency_model(_prefill(lambda n: 0.1 + 0.03 * n, shares))
    assert model.cpu_share == tuple(shares.items())
    for n, ms in shares.items():
        assert model.cpu_expert_ms(n) == pytest.approx(ms)
    assert model.cpu_expert_ms(24) == pytest.approx((0.2 + 0.33) / 2)  # between counts: a straight line
    assert model.cpu_expert_ms(128) == pytest.approx(0.6 + 64 * (0.6 - 0.33) / 32)  # past them: the last slope
    assert model.cpu_expert_ms(1) == pytest.approx(0.1 + 0.03)  # below 8 tokens the line,
    assert model.cpu_expert_ms(4) == pytest.approx(0.16)  # never above the 8-token share
    assert LatencyModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    # Read back from JSON (string keys) the profile fits the same model.
    assert fit_latency_model(json.loads(json.dumps(_prefill(lambda n: 0.1 + 0.03 * n, shares)))) == model


def test_prefill_shares_are_read_on_the_path_in_use_and_can_be_left_out():
    raw = _prefill(lambda n: 0.1 + 0.03 * n, {8: 0.12, 16: 0.2}, path="amx")
    raw["cpu_prefill_ms"]["vnni"] = {8: 8 * 0.3, 16: 8 * 0.5}
    assert fit_latency_model(raw).cpu_expert_ms(16) == pytest.approx(0.2)  # the profile's choice
    assert fit_latency_model(raw, cpu_path="vnni").cpu_expert_ms(16) == pytest.approx(0.5)  # AMX refused here
    assert fit_latency_model(raw, cpu_path="avx2").cpu_share == ()  # a path not measured: the line prices it
    old = fit_latency_model(raw, prefill_rates=False)
    assert old.cpu_share == () and old.cpu_expert_ms(16) == pytest.approx(0.1 + 0.03 * 16)


def test_a_prefill_share_never_falls_below_reading_the_expert_nor_with_more_tokens():
    floor = 13 * MiB / 100e6
    model = fit_latency_model(_prefill(lambda n: 0.2 + 0.03 * n, {8: 0.05, 16: 0.2, 32: 0.18},
                                       expert_bytes=13 * MiB, cpu_read_gbs=100.0))
    assert model.cpu_expert_ms(8) == pytest.approx(floor)
    assert model.cpu_expert_ms(32) == pytest.approx(0.2)  # a dip measured at 32 is noise


def test_copies_queued_back_to_back_are_priced_at_the_steps_load():
    model = fit_latency_model(profile(lambda n: 1.0, copy_launch_ms=0.2, copy_launch_prefill_ms={16: 0.4, 64: 0.6}))
    assert model.copy_launch_ms == 0.2  # a lone drained copy, as decode queues it
    assert model.copy_launch_at(16) == pytest.approx(0.4) and model.copy_launch_at(40) == pytest.approx(0.5)
    assert model.copy_launch_at(512) == pytest.approx(0.6)  # held past the last load measured
    # Below it, a line down to the lone drained copy at its two tokens (decode's price).
    assert model.copy_launch_at(2) == pytest.approx(0.2) and model.copy_launch_at(9) == pytest.approx(0.3)
    without = fit_latency_model(profile(lambda n: 1.0, copy_launch_ms=0.2))
    assert without.copy_launch_at(16) == 0.2


@pytest.mark.parametrize("bad", [{"cpu_prefill_ms": {"vnni": {8: -1.0}}, "cpu_prefill_experts": 8},
                                 {"cpu_prefill_ms": {"vnni": {8: 1.0}}},  # no experts count
                                 {"cpu_prefill_ms": [1, 2], "cpu_prefill_experts": 8},
                                 {"copy_launch_prefill_ms": {0: 0.3}}])
def test_bad_prefill_measurements_are_refused(bad):
    with pytest.raises(ProfileError):
        fit_latency_model(profile(lambda n: 1.0, cpu_path="vnni", **bad))
