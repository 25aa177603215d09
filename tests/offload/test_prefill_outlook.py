"""A whole prefill predicted from its layers' routing (engine.offload.prefill_outlook): hand-made costs whose
timelines can be worked out on paper, no GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest

from moedesk.engine.offload.assignment import Costs, assign_offloaded
from moedesk.engine.offload.latency_model import fit_latency_model
from moedesk.engine.offload.prefill_outlook import (LayerOutlook, PrefillOutlook, fixed_ms_for, layer_outlook,
                                                    link_bound_ms, prefetch_ahead, prefill_outlook,
                                                    prefill_outlook_ahead, resident_gpu_ms, shared_bound_ms)

# CPU: 0.1 ms a token an expert; a copy 2 ms; the GPU's compute free (Costs has no contention, launches or call cost).
LINEAR = Costs(cpu_ms=lambda n: 0.1 * n, gpu_ms=lambda n: 0.0, copy_ms=2.0)


def test_a_layer_prices_the_split_the_executor_makes_and_the_resident_work_before_the_copies():
    loads = {0: 40, 1: 10, 2: 5}  # CPU 4, 1, 0.5 ms; a copy 2 ms
    split = assign_offloaded(loads, LINEAR, overlap=True, grouped_copies=True)
    assert (split.copy, split.cpu) == ((0,), (1, 2))  # the dear one copied: GPU 2, CPU 1.5
    layer = layer_outlook(loads, LINEAR)
    assert (layer.cpu_ms, layer.gpu_ms, layer.link_ms) == pytest.approx((1.5, 2.0, 2.0))
    assert (layer.cpu_experts, layer.copies, layer.window_ms) == (2, 1, 2.0)
    # 3 ms of resident experts first: the copy lands at 2, its compute waits for them (the split is not told).
    busy = layer_outlook(loads, LINEAR, resident_ms=3.0)
    assert (busy.copies, busy.gpu_ms, busy.window_ms) == (1, 3.0, 3.0)


def test_a_layer_with_nothing_offloaded_is_its_resident_work():
    layer = layer_outlook({0: 0}, LINEAR, resident_ms=0.7)
    assert (layer.cpu_ms, layer.gpu_ms, layer.link_ms, layer.copies, layer.cpu_experts) == (0.0, 0.7, 0.0, 0, 0)


def test_the_prefill_sums_its_layers_and_reads_tok_s_and_the_links_share():
    layers = [({0: 40, 1: 10, 2: 5}, 0.0), ({0: 40, 1: 10, 2: 5}, 3.0), ({}, 1.0)]
    outlook = prefill_outlook(layers, LINEAR, tokens=512, fixed_ms=10.0)
    assert outlook.counts() == (4, 2)
    assert (outlook.cpu_ms, outlook.link_ms, outlook.gpu_ms) == pytest.approx((3.0, 4.0, 6.0))
    assert outlook.expert_ms == pytest.approx(2.0 + 3.0 + 1.0)
    assert outlook.overlap_ms == pytest.approx(1.5 + 1.5 + 0.0)
    assert outlook.total_ms == pytest.approx(16.0)
    assert outlook.tok_s == pytest.approx(512 / 0.016)
    assert outlook.link_busy == pytest.approx(4.0 / 16.0)


def test_the_shared_bound_splits_the_whole_prefill_between_cpu_and_link():
    # Four experts of 4 ms on the CPU, copies of 2 ms: two copied (4 ms of link), two on the CPU (8 ms) would not
    # balance; the fractional optimum moves 2 + 2/3 experts: CPU 16 - 8/3 * 4 = 5.33 = link 8/3 * 2.
    assert shared_bound_ms([40, 40, 40, 40], LINEAR) == pytest.approx(16 / 3)
    # The dearest go first: one 10 ms expert copied (2 ms), the CPU keeps 1 + 1 = 2 ms: equal, no fraction.
    assert shared_bound_ms([100, 10, 10], LINEAR) == pytest.approx(2.0)
    # Cheap experts: a whole copy (2 ms) would outlast the CPU (1 ms); 0.4 of one moves, both sides end at 0.8.
    assert shared_bound_ms([5, 5], LINEAR) == pytest.approx(0.8)
    assert shared_bound_ms([], LINEAR) == 0.0 and shared_bound_ms([0, 0], LINEAR) == 0.0
    # Never above the link bound (everything copied) nor above everything on the CPU.
    loads = [3, 17, 60, 8, 8, 120, 1]
    assert shared_bound_ms(loads, LINEAR) <= min(link_bound_ms(len(loads), 2.0), 0.1 * sum(loads))


def test_resident_experts_are_one_grouped_launch_up_to_its_limit_then_one_gemm_each():
    gpu = Costs(cpu_ms=lambda n: 0.0, gpu_ms=lambda n: 0.5 + 0.001 * n, copy_ms=2.0)
    assert resident_gpu_ms([64, 10, 0], gpu, grouped_max=64) == pytest.approx(0.5 + 0.074)
    assert resident_gpu_ms([65, 10], gpu, grouped_max=64) == pytest.approx(0.565 + 0.51)
    assert resident_gpu_ms([], gpu, grouped_max=64) == 0.0
    # Given the experts' shape, as the executor decides (`resident_grouped`): small ones stay grouped past the limit.
    assert resident_gpu_ms([65, 10], gpu, 64, shape=(2048, 768)) == pytest.approx(0.5 + 0.075)
    assert resident_gpu_ms([65, 10], gpu, 64, shape=(4096, 14336)) == pytest.approx(0.565 + 0.51)


def test_prefetch_takes_the_dearest_on_the_cpu_first_within_the_links_free_time_and_the_slots():
    expected = {3: 5.0, 1: 40.0, 2: 10.0, 4: 0.0}
    assert prefetch_ahead(expected, LINEAR, link_free_ms=4.5, slots=8) == [1, 2]  # two 2 ms copies fit in 4.5 ms
    assert prefetch_ahead(expected, LINEAR, link_free_ms=100.0, slots=8) == [1, 2, 3]  # never one expecting nothing
    assert prefetch_ahead(expected, LINEAR, link_free_ms=100.0, slots=1) == [1]
    assert prefetch_ahead(expected, LINEAR, link_free_ms=1.9, slots=8) == []


def test_an_expert_copied_a_layer_ahead_costs_the_layer_its_compute_alone():
    loads = {0: 40, 1: 10, 2: 5}
    gpu = Costs(cpu_ms=lambda n: 0.1 * n, gpu_ms=lambda n: 0.01 * n, copy_ms=2.0)
    layer = layer_outlook(loads, gpu, resident_ms=0.5, ahead=[0, 1, 9])  # 9: copied, but routed nothing here
    # Left to the split: expert 2 (0.5 ms on the CPU, against a 2 ms copy); 0 and 1 computed after the resident ones.
    assert (layer.cpu_experts, layer.copies) == (1, 0)
    assert layer.cpu_ms == pytest.approx(0.5) and layer.gpu_ms == pytest.approx(0.5 + 0.5)
    assert (layer.link_ms, layer.ahead_link_ms) == (0.0, pytest.approx(6.0))  # a copy that bought nothing took the link
    assert layer_outlook(loads, gpu, resident_ms=0.5, ahead=[0, 1]) == replace(layer, ahead_link_ms=pytest.approx(4.0))
    everything = layer_outlook(loads, gpu, ahead=[0, 1, 2])
    assert (everything.cpu_ms, everything.cpu_experts, everything.copies) == (0.0, 0, 0)


def test_copies_made_a_layer_ahead_shorten_a_prefill_whose_link_idles():
    # Two layers of one heavy and one light expert; 3 ms a layer outside the windows.
    layers = [({0: 40, 1: 5}, 0.0), ({0: 40, 1: 5}, 0.0)]
    expected = [{0: 40.0, 1: 5.0}, {0: 40.0, 1: 5.0}]
    today = prefill_outlook(layers, LINEAR, tokens=512, fixed_ms=6.0)
    ahead = prefill_outlook_ahead(layers, expected, LINEAR, tokens=512, fixed_ms=6.0, slots=8)
    # Today each layer copies the heavy one (GPU 2 ms, CPU 0.5): windows 2 + 2. Ahead: layer 0 as today; during it
    # the link has 3 + 2 - 2 = 3 ms free, one copy's worth: layer 1's heavy expert lands early, its CPU keeps the
    # light one (0.5 ms).
    assert today.expert_ms == pytest.approx(4.0)
    assert ahead.expert_ms == pytest.approx(2.0 + 0.5) and ahead.tok_s > today.tok_s
    assert ahead.link_ms == pytest.approx(today.link_ms)  # the same copies, made earlier
    assert prefill_outlook_ahead(layers, expected, LINEAR, 512, 6.0, slots=0).expert_ms == pytest.approx(4.0)
    # The staging's slots less the layer's own copies: one slot, which layer 0's copy takes, leaves none for ahead.
    assert prefill_outlook_ahead(layers, expected, LINEAR, 512, 6.0, slots=1).expert_ms == pytest.approx(4.0)
    assert prefill_outlook_ahead(layers, expected, LINEAR, 512, 6.0, slots=2) == ahead


def test_the_time_left_outside_the_experts_for_a_target():
    assert fixed_ms_for(4000.0, 512, 100.0) == pytest.approx(28.0)
    assert fixed_ms_for(4000.0, 512, 200.0) < 0  # out of reach whatever else


def test_mixtral_at_16_gib_session_36s_profile_each_layer_copies_its_one_heavy_expert():
    """Session 36's Mixtral-8x7B Q4_K profile on the H200 box (tests/perf/whole_targets.sh, data of session 37): a layer
    of one heavy offloaded expert and two light ones copies the heavy one and computes the light ones on the CPU, and
    one more copy would cost the GPU's side a whole copy (1.8 ms), more than the CPU's call saves."""
    model = fit_latency_model(mixtral_profile(), "amx")
    layer = layer_outlook({0: 56, 1: 6, 2: 4}, model)
    assert (layer.copies, layer.cpu_experts) == (1, 2)
    assert layer.link_ms == pytest.approx(1.8 * 1.024, rel=0.02)  # slowed by the CPU's call beside it
    assert 2.5 < layer.cpu_ms < 3.5 and layer.gpu_ms < layer.cpu_ms
    # Four resident experts of ~240 tokens before the copy (one GEMM each above 64 tokens): the GPU's side ends later.
    busy = layer_outlook({0: 56, 1: 6, 2: 4}, model, resident_ms=4 * model.gpu_expert_ms(240))
    assert busy.copies == 1 and busy.gpu_ms > layer.gpu_ms


def test_a_prefill_outlook_is_plain_data():
    layer = LayerOutlook(1.0, 2.0, 2.0, 1, 1)
    assert PrefillOutlook(8, (layer,), 0.0).tok_s == pytest.approx(4000.0)
    assert PrefillOutlook(8, (), 0.0).tok_s == float("inf") and PrefillOutlook(8, (), 0.0).link_busy == 0.0


def mixtral_profile() -> dict:
    """The start-up profile session 36 measured for Mixtral-8x7B's Q4_K experts (99 MB each) on the H200 box."""
    return {
        "cpu_expert_ms": {1: 0.930, 2: 0.981, 4: 1.134, 8: 2.271, 16: 4.199, 32: 8.136, 64: 14.85, 128: 31.29,
                          256: 62.04},
        "cpu_call_ms": {1: 3.153, 2: 3.276, 4: 3.816, 8: 7.238, 16: 14.71}, "cpu_call_experts": 4,
        "gpu_expert_ms": {1: 0.183, 4: 0.531, 16: 0.514, 64: 0.411, 256: 0.528, 1024: 0.913, 4096: 2.878},
        "copy_expert_ms": 1.804, "activation_roundtrip_ms": 0.0385, "expert_bytes": 99090432, "h2d_gbs": 54.93,
        "cpu_read_gbs": 139.8,
        "cpu_slowdown_during_copy": {1: 1.121, 4: 1.139, 16: 1.129},
        "copy_slowdown_during_cpu": {1: 1.119, 4: 1.049, 16: 1.024},
        "copy_launch_ms": 0.2209, "resident_launch_ms": 0.2704,
        "cpu_prefill_ms": {"vnni": {8: 13.49, 16: 28.45, 32: 52.27, 64: 101.8},
                           "amx": {8: 13.28, 16: 14.72, 32: 28.35, 64: 58.30}},
        "cpu_prefill_experts": 8, "cpu_path": "amx",
        "copy_launch_prefill_ms": {16: 0.2669, 64: 0.4541}, "copy_queue_prefill_ms": 0.0881,
    }
