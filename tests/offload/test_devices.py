"""The per-device plan over simulated GPUs (engine.offload.devices): pure decisions, no device needed."""
import numpy as np
import pytest

from moedesk.engine.offload.devices import (DeviceCountError, check_device_budgets, format_device_plan, plan_devices,
                                            split_layers)
from moedesk.engine.offload.placement import BudgetError, LayerCosts, plan_placement

MIB = 2**20
LAYERS, EXPERTS = 8, 4


def _popularity(seed=0):
    return np.random.default_rng(seed).integers(0, 100, size=(LAYERS, EXPERTS))


def _plan(budgets, **kw):
    return plan_devices([b * MIB for b in budgets], 10 * MIB, EXPERTS, kw.pop("popularity", _popularity()),
                        [20 * MIB] * LAYERS, [5 * MIB] * LAYERS, **kw)


def test_equal_budgets_split_the_layers_in_half_consecutively():
    plan = _plan([200, 200])
    assert plan.device_of_layer == (0, 0, 0, 0, 1, 1, 1, 1)
    assert plan.crossings() == 1
    assert [plan.layers(d) for d in (0, 1)] == [range(0, 4), range(4, 8)]
    # each device: 4 layers' weights and cache, then 100 MiB of its 200 for experts
    assert plan.bytes_per_device == (200 * MIB, 200 * MIB)
    assert [p.experts_on_gpu for p in plan.placements] == [10, 10]
    assert plan.kv_bytes == (20 * MIB, 20 * MIB)


def test_unequal_budgets_split_in_proportion():
    plan = _plan([300, 100])  # 3 : 1 of 8 equal layers
    assert plan.device_of_layer == (0,) * 6 + (1,) * 2
    # the embeddings on the first device and the head on the last move the cut toward what each holds
    assert split_layers([100, 100], [10] * 8, first_bytes=40) == (0,) * 2 + (1,) * 6
    assert split_layers([100, 100], [10] * 8, last_bytes=40) == (0,) * 6 + (1,) * 2
    assert split_layers([1, 1, 1], [10] * 9) == (0, 0, 0, 1, 1, 1, 2, 2, 2)


def test_every_device_gets_a_layer_while_there_are_enough():
    assert split_layers([1000, 1], [10] * 4) == (0, 0, 0, 1)
    assert split_layers([1, 1000], [10] * 4) == (0, 1, 1, 1)


def test_each_device_places_its_own_hot_experts_with_the_single_device_rule():
    pop = _popularity(3)
    plan = _plan([200, 160], popularity=pop)
    for d, place in enumerate(plan.placements):
        layers = list(plan.layers(d))
        alone = plan_placement(10 * MIB, len(layers), EXPERTS, pop[layers], plan.budgets[d], len(layers) * 20 * MIB,
                               len(layers) * 5 * MIB)
        assert np.array_equal(place.on_gpu, alone.on_gpu)
    assert plan.on_gpu().shape == (LAYERS, EXPERTS)
    assert all(b <= budget for b, budget in zip(plan.bytes_per_device, plan.budgets))


def test_one_device_is_todays_plan_exactly():
    pop = _popularity(7)
    costs = LayerCosts(roundtrip_ms=0.3, resident_launch_ms=0.05, cpu_expert_ms=0.4, cpu_call_ms=0.1)
    for budget in (216, 300, 395):
        plan = _plan([budget], popularity=pop, first_bytes=7 * MIB, last_bytes=9 * MIB, layer_costs=costs, top_k=2)
        today = plan_placement(10 * MIB, LAYERS, EXPERTS, pop, budget * MIB, LAYERS * 20 * MIB + 16 * MIB,
                               LAYERS * 5 * MIB, layer_costs=costs, top_k=2)
        assert plan.device_of_layer == (0,) * LAYERS
        assert np.array_equal(plan.placements[0].on_gpu, today.on_gpu)
        assert plan.bytes_per_device == (today.bytes_used,)


def test_a_budget_too_small_for_its_layers_weights_is_one_line_naming_the_device():
    with pytest.raises(BudgetError) as err:
        _plan([400, 20])  # GPU 1 gets one layer at least, whose 25 MiB of weights and cache do not fit 20
    message = str(err.value)
    assert "GPU 1" in message and "layers" in message and "--gpu-budget" in message and "\n" not in message


def test_dense_layers_hold_no_experts_and_are_still_split():
    is_moe = [False, True, True, True, True, True, True, False]
    pop = np.ones((6, EXPERTS))
    plan = plan_devices([300 * MIB, 300 * MIB], 10 * MIB, EXPERTS, pop, [20 * MIB] * LAYERS, [5 * MIB] * LAYERS,
                        is_moe=is_moe)
    assert plan.moe_layers == ((1, 2, 3), (4, 5, 6))
    assert [p.on_gpu.shape for p in plan.placements] == [(3, EXPERTS), (3, EXPERTS)]


def test_budget_figures_against_the_gpus_detected():
    assert check_device_budgets([16.0], 0) == (16.0,)  # one figure: today's, GPU or not
    assert check_device_budgets([16, 12.5], 2) == (16.0, 12.5)
    for budgets, gpus in (([16, 16], 1), ([16, 16, 16], 2), ([16, 16], 0)):
        with pytest.raises(DeviceCountError) as err:
            check_device_budgets(budgets, gpus)
        assert f"names {len(budgets)} GPUs" in str(err.value) and f"has {gpus} CUDA GPU" in str(err.value)
    with pytest.raises(DeviceCountError, match=">= 0"):
        check_device_budgets([16, -1], 2)


def test_the_plan_is_printed_device_by_device():
    pop = _popularity()
    plan = _plan([200, 200], popularity=pop)
    lines = format_device_plan(plan, pop)
    assert lines[0] == "per-device plan over 2 GPUs, 1 device crossing(s) per token:"
    assert lines[1].startswith("  GPU 0: layers 0-3") and lines[2].startswith("  GPU 1: layers 4-7")
    assert "10 of 16 experts" in lines[1] and "hit rate" in lines[1]


def test_a_layer_count_below_the_device_count_leaves_the_last_devices_empty():
    plan = plan_devices([100 * MIB] * 3, 10 * MIB, EXPERTS, np.ones((2, EXPERTS)), [20 * MIB] * 2, [5 * MIB] * 2)
    owner = plan.device_of_layer
    assert len(owner) == 2 and list(owner) == sorted(owner) and plan.crossings() == 1
    empty = ({0, 1, 2} - set(owner)).pop()
    assert plan.layers(empty) == range(0) and plan.placements[empty].experts_on_gpu == 0
    assert f"GPU {empty}: no layers" in format_device_plan(plan)[1 + empty]


@pytest.mark.gpu
def test_two_real_gpus_are_counted_and_planned(tmp_path, monkeypatch, capsys):
    """On the two-GPU box: detection counts both, and `moedesk profile` plans and loads a tiny Mixtral over them
    (budgets that leave each GPU some layers' weights and experts)."""
    import torch

    from moedesk.app.cli import main
    from moedesk.engine.hardware import cuda_device_count, detect_hardware
    from tests.offload.test_device_orchestra import _budgets_holding
    from tests.tiny_models import build

    if cuda_device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    assert cuda_device_count() == torch.cuda.device_count() == len(detect_hardware().gpus)
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    model = build("mixtral", tmp_path / "mixtral", num_hidden_layers=4)
    figures = ",".join(f"{b:.6f}" for b in _budgets_holding(model, (3, 5), context=1024))
    assert main(["profile", "--model", str(model), "--context", "1024", "--gpu-budget", figures]) == 0
    out = capsys.readouterr().out
    assert "per-device plan over 2 GPUs, " in out and "  GPU 1: layers " in out
    assert main(["profile", "--model", str(model), "--gpu-budget", ",".join(["1"] * (cuda_device_count() + 1))]) != 0
    assert "names" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen3.5-35b-a3b"])
def test_layer_sizes_add_up_to_the_single_budget_figures(shape):
    """Per layer sizes sum to what engine.offload.gpu_budget counts for the whole model on one GPU."""
    from moedesk.engine.load.synthetic import shape_config
    from moedesk.engine.offload.devices import layer_sizes
    from moedesk.engine.offload.gpu_budget import kv_bytes_per_position, non_expert_bytes

    cfg = shape_config(shape)
    weights, kv, moe, first, last = layer_sizes(cfg, 2, 4096)
    assert sum(weights) + first + last == non_expert_bytes(cfg, 2)
    assert sum(kv) == 4096 * kv_bytes_per_position(cfg, 2)
    assert any(moe) and len(weights) == len(kv) == cfg.num_layers
    # on two GPUs a tied head needs its own copy on the last one
    assert layer_sizes(cfg, 2, 4096, devices=2)[4] == cfg.vocab_size * cfg.hidden_size * 2
    fixed, expert = sum(weights) + sum(kv) + first + last, 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    plan = plan_devices([fixed, fixed], expert, cfg.num_experts, np.ones((sum(moe), cfg.num_experts)), weights, kv,
                        moe, first, last)
    # equal budgets: the two halves of the model's bytes differ by less than a layer (dense layers are lighter)
    size = [w + c + (cfg.num_experts * expert if m else 0) for w, c, m in zip(weights, kv, moe)]
    halves = [sum(size[i] for i in plan.layers(d)) for d in (0, 1)]
    assert plan.crossings() == 1 and abs(halves[0] + first - halves[1] - last) <= max(size)
