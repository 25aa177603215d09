"""A prefill step's split between the CPU and the copies, priced from the profile's rates at prefill loads
(engine.offload.latency_model's cpu_share and copy_launch_at) on the kernel path chosen for them
(engine.offload.cpu_paths): hand-made profiles of gpt-oss-120b's shape, no GPU."""
import numpy as np
import pytest

from moedesk.engine.offload.assignment import assign_offloaded, assignment_for
from moedesk.engine.offload.cpu_paths import MIN_GAIN, choose_cpu_path
from moedesk.engine.offload.latency_model import fit_latency_model

CPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHARES = {8: 0.16, 16: 0.2, 32: 0.36, 64: 0.68}  # an expert's share of calls of eight, ms


def prefill_loads(tokens=512, experts=128, top_k=4, seed=0) -> dict[int, int]:
    """Tokens per expert of one prefill step: each token routed to top_k distinct experts at random."""
    rng = np.random.default_rng(seed)
    picks = np.array([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).ravel()
    counts = np.bincount(picks, minlength=experts)
    return {e: int(n) for e, n in enumerate(counts) if n}


def gpt_oss_profile(rates: bool, launch_back_to_back: float | None = None, **extra) -> dict:
    """One MXFP4 expert of gpt-oss-120b (13 MB): copied in 0.245 ms (54 GB/s), computed by the GPU in a few
    hundredths; on the CPU one-expert calls cost 0.1 + 0.03 ms a token (threads idle), calls of eight SHARES."""
    points = {"cpu_expert_ms": {n: 0.1 + 0.03 * n for n in CPU_TOKENS},
              "gpu_expert_ms": {1: 0.02, 16: 0.025, 64: 0.04, 256: 0.1}, "copy_expert_ms": 0.245,
              "copy_launch_ms": 0.05, "expert_bytes": 13_200_000, "cpu_read_gbs": 130.0, **extra}
    if rates:
        points.update(cpu_prefill_ms={"vnni": {n: 8 * ms for n, ms in SHARES.items()}}, cpu_prefill_experts=8,
                      cpu_path="vnni")
        if launch_back_to_back is not None:
            points["copy_launch_prefill_ms"] = {16: launch_back_to_back, 64: launch_back_to_back}
    return points


def test_the_cpu_takes_the_share_it_finishes_before_the_copy_of_the_rest():
    loads = prefill_loads()
    assert 15 < np.mean(list(loads.values())) < 17
    old = assign_offloaded(loads, fit_latency_model(gpt_oss_profile(rates=False)))
    true = fit_latency_model(gpt_oss_profile(rates=True))
    new = assign_offloaded(loads, true)
    assert len(new.cpu) > len(old.cpu) + 20  # the one-expert calls' slope had the CPU look 2.5x dearer
    # Priced as the CPU really runs (the calls of eight): the step ends sooner than with the old split, sooner than
    # either side alone, and the CPU's share ends about when the copies of the rest do.
    old_priced = assignment_for(loads, old.copy, true)
    alone = [assignment_for(loads, [], true), assignment_for(loads, list(loads), true)]
    assert new.makespan_ms < 0.85 * old_priced.makespan_ms
    assert new.makespan_ms < min(a.makespan_ms for a in alone)
    assert abs(new.cpu_finish_ms - new.gpu_finish_ms) <= true.cpu_expert_ms(max(loads.values())) + true.copy_expert_ms
    # The CPU keeps the lightest experts: copying costs every expert the same, computing grows with its tokens.
    assert max(loads[e] for e in new.cpu) <= min(loads[e] for e in new.copy)


def test_copies_queued_back_to_back_move_experts_to_the_cpu():
    """Each copy costs the host thread its launch before the CPU call starts; measured back to back at a prefill's
    loads it is dearer than the lone drained copy, and experts the CPU computes in less time stay there."""
    loads = prefill_loads(seed=1)
    drained = assign_offloaded(loads, fit_latency_model(gpt_oss_profile(rates=True)))
    queued = assign_offloaded(loads, fit_latency_model(gpt_oss_profile(rates=True, launch_back_to_back=0.4)))
    assert drained.copy and not queued.copy
    assert queued.makespan_ms == pytest.approx(sum(SHARES[16] + (n - 16) * 0.01 for n in loads.values()), rel=0.1)


def test_with_the_cpu_call_beside_the_queueing_the_launches_pace_the_copies_not_the_cpu():
    """OffloadExecutor's overlap_copies: the CPU computes while the host queues the copies, so a launch dearer
    than the link paces the copies, and the CPU and the copies share the step again."""
    loads = prefill_loads(seed=1)
    model = fit_latency_model(gpt_oss_profile(rates=True, launch_back_to_back=0.4))
    serial = assign_offloaded(loads, model)
    overlapped = assign_offloaded(loads, model, overlap=True)
    assert not serial.copy and 30 < len(overlapped.copy) < 70
    assert overlapped.makespan_ms < 0.75 * serial.makespan_ms
    assert overlapped.gpu_finish_ms == pytest.approx(0.4 * len(overlapped.copy) + 0.025, rel=0.05)  # 0.4 a copy
    assert abs(overlapped.cpu_finish_ms - overlapped.gpu_finish_ms) <= 0.4 + model.cpu_expert_ms(max(loads.values()))
    # A launch cheaper than the link: the link's pace, and the CPU pays nothing for the copies.
    cheap = fit_latency_model(gpt_oss_profile(rates=True, launch_back_to_back=0.1))
    split = assign_offloaded(loads, cheap, overlap=True)
    assert split.gpu_finish_ms == pytest.approx(0.245 * len(split.copy) + 0.025, rel=0.05)
    assert split.cpu_finish_ms == pytest.approx(sum(cheap.cpu_expert_ms(loads[e]) for e in split.cpu), rel=1e-6)


def test_the_split_with_contention_still_compares_each_side_alone_at_the_steps_prices():
    # Contention measured: the split is weighed against each side alone, which pays the back-to-back launches too.
    loads = prefill_loads(seed=2)
    model = fit_latency_model(gpt_oss_profile(rates=True, launch_back_to_back=0.4, cpu_slowdown_during_copy=1.3,
                                              copy_slowdown_during_cpu=1.2))
    split = assign_offloaded(loads, model)
    assert not split.copy  # all on the CPU, not all copied at the lone copy's launch price
    assert split.makespan_ms == pytest.approx(assignment_for(loads, [], model).cpu_finish_ms)


def test_decode_is_priced_as_before():
    # One token's four experts: the line prices them (under the 8-token share), the copy launch is the lone one's.
    loads = {3: 1, 17: 1, 40: 1, 99: 1}
    old = assign_offloaded(loads, fit_latency_model(gpt_oss_profile(rates=False)))
    new = assign_offloaded(loads, fit_latency_model(gpt_oss_profile(rates=True, launch_back_to_back=0.4)))
    assert (old.cpu, old.copy) == (new.cpu, new.copy)


def test_the_faster_path_is_chosen_only_when_it_gains_enough():
    vnni = {8: 1.0, 16: 2.0, 32: 4.0, 64: 8.0}
    assert choose_cpu_path({"vnni": vnni}) == "vnni"
    amx = {n: ms * (1 - MIN_GAIN) * 0.9 for n, ms in vnni.items()}
    assert choose_cpu_path({"vnni": vnni, "amx": amx}) == "amx"
    barely = {n: ms * (1 - MIN_GAIN / 2) for n, ms in vnni.items()}
    assert choose_cpu_path({"vnni": vnni, "amx": barely}) == "vnni"
    # Compared over the counts both measured; none shared, or the default not measured: the default.
    assert choose_cpu_path({"vnni": vnni, "amx": {16: 0.5}}) == "amx"
    assert choose_cpu_path({"vnni": vnni, "amx": {128: 0.5}}) == "vnni"
    assert choose_cpu_path({"amx": amx}) == "vnni"
    assert choose_cpu_path({"dense": vnni}, default="dense") == "dense"


def test_the_profiles_path_is_taken_where_this_process_can_and_vnni_where_it_cannot(monkeypatch):
    from moedesk.engine.offload.cpu_paths import apply_cpu_path
    from moedesk.kernels import cpu_quant as cq

    if not cq.available() or not cq.vnni_supported() or cq.amx_supported():
        pytest.skip("needs the packed kernel's VNNI path on a CPU without AMX")
    monkeypatch.delenv("MOEDESK_QUANT_PATH", raising=False)
    assert apply_cpu_path({}) is None  # a profile from before paths were measured
    assert apply_cpu_path({"cpu_path": "dense"}) == "dense"  # unpacked experts: nothing to set
    warnings = []
    assert apply_cpu_path({"cpu_path": "amx"}, warnings) == "vnni" == cq.get_path()  # a profile cached elsewhere
    assert len(warnings) == 1 and "amx" in warnings[0] and "using vnni" in warnings[0]
    monkeypatch.setenv("MOEDESK_QUANT_PATH", "avx2")
    cq.set_path("avx2")
    try:  # the user's path stands, and the model reads the rates measured on it
        assert apply_cpu_path({"cpu_path": "vnni"}) == "avx2" == cq.get_path()
    finally:
        cq.set_path(None)


def test_the_orchestra_prices_prefill_from_its_profile_unless_told_not_to(tmp_path, monkeypatch):
    import torch

    from moedesk.engine.offload.orchestration import ExpertOrchestra
    from moedesk.kernels.expert_weights import ExpertWeights

    hidden, width = 64, 32
    banks = {0: ExpertWeights(torch.randn(8, 2 * width, hidden), torch.randn(8, hidden, width), hidden, width)}
    monkeypatch.delenv("MOEDESK_NO_PREFILL_RATES", raising=False)
    measured = ExpertOrchestra.start(banks, torch.device("cpu"), ("test", (hidden, width)), tmp_path, top_k=2)
    assert measured.profile["cpu_path"] == "dense" and set(measured.profile["cpu_prefill_ms"]["dense"]) == {8, 16, 32, 64}
    assert [n for n, _ in measured.costs.cpu_share] == [8, 16, 32, 64]
    monkeypatch.setenv("MOEDESK_NO_PREFILL_RATES", "1")
    before = ExpertOrchestra.start(banks, torch.device("cpu"), ("test", (hidden, width)), tmp_path, top_k=2)
    assert before.profile == measured.profile  # the cached profile, priced as before its prefill rates
    assert before.costs.cpu_share == () and before.costs.copy_launch_by_tokens == ()
