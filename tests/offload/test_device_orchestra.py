"""Engine.load with one --gpu-budget figure per device: the model's layers run spread over the devices as the per-device
plan says, each device with its own experts resident and its own executor, and the text is one device's.

Two "cpu" devices stand for two GPUs (Engine.load's `devices`; on the CPU the CPU tier simulates the GPU's, as for
one device); tests/offload/test_device_orchestra_gpu.py runs the same on two CUDA devices.
"""
import pytest
import torch

from moedesk.engine.offload.device_orchestra import DeviceExecutors
from moedesk.engine.offload.offload_executor import OffloadExecutor, StepStats
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model
from tests.tiny_models import build

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b"]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
GIB = 2**30


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A tiny Mixtral of four layers (two per device) and 4 experts each."""
    return build("mixtral", tmp_path_factory.mktemp("mixtral4"), num_hidden_layers=4)


def _generate(engine, prompts=PROMPTS, batch_size=2):
    ids = [engine.tokenizer.encode(p) for p in prompts]
    done = {c.tag: c for c in engine.generate([Request(p, GREEDY, tag=i) for i, p in enumerate(ids)], batch_size)}
    return [done[i].token_ids for i in range(len(ids))]


def _budgets_holding(folder, experts: tuple[int, ...], devices=("cpu", "cpu"), context: int = 64) -> tuple:
    """Per-device budgets (GiB) that leave room for `experts[d]` experts beside device d's weights and KV cache: a
    probe with ample budgets says what each device's layers hold first."""
    probe = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, context_length=context,
                        gpu_budget=(1.0,) * len(devices), devices=devices)
    size = probe.orchestra.expert_bytes
    return tuple((p.non_expert_bytes + p.reserve_bytes + n * size + size // 2) / GIB
                 for p, n in zip(probe.device_plan.placements, experts))


def test_two_devices_give_transformers_greedy_text_with_each_devices_own_experts(four_layers):
    budgets = _budgets_holding(four_layers, (3, 5))
    engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cpu", "cpu"))
    plan, spread = engine.device_plan, engine.model.spread
    assert spread.device_of_layer == plan.device_of_layer == (0, 0, 1, 1)
    assert engine.device_links == []  # a device and itself: no link to time
    assert [p.experts_on_gpu for p in plan.placements] == [3, 5]
    # Each device's executor holds its own layers' banks and exactly the experts the plan chose for them.
    parts = engine.executor.executors
    assert [sorted(e.banks) for e in parts] == [[0, 1], [2, 3]]
    assert [e.on_gpu() for e in parts] == [p.on_gpu.tolist() for p in plan.placements]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(four_layers), engine.tokenizer.encode(p), GREEDY.max_new_tokens, eos)
                for p in PROMPTS]
    assert _generate(engine) == expected
    stats = engine.expert_stats()
    # Resident and offloaded experts both ran (the offloaded on the CPU or copied over, as each step's split says).
    assert 0 < stats["experts_gpu"] and 0 < stats["experts_cpu"] + stats["experts_copied"] + stats["experts_zero_copy"]
    assert [d["experts_on_gpu"] for d in stats["devices"]] == [3, 5]
    assert [d["moe_layers"] for d in stats["devices"]] == [[0, 1], [2, 3]]
    assert stats["experts_on_gpu"] == 8 and stats["experts_total"] == 16
    from moedesk.app.tui.catalog import human_size
    from moedesk.app.tui.screens.chat import model_summary  # the chat's stats panel says the same

    assert model_summary(engine).split("\n")[-2:] == [
        f"GPU {d['device']}: MoE layers {d['moe_layers'][0]}-{d['moe_layers'][1]} · {d['experts_on_gpu']} experts · "
        f"{human_size(d['held_bytes'])} of {human_size(d['budget_bytes'])}" for d in stats["devices"]]
    assert [int(b * GIB) for b in budgets] == [d["budget_bytes"] for d in stats["devices"]]
    # One hidden-state copy per forward at the one cut: a lone forward shows it.
    before = spread.crossings
    engine.model(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], engine.model.new_cache(1, 8, torch.float32, "cpu"),
                 engine.executor)
    assert spread.crossings - before == plan.crossings() == 1


def test_one_device_is_unchanged_and_matches_two(four_layers):
    one = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64, gpu_budget=0)
    assert one.model.spread is None and one.device_plan is None and "devices" not in one.expert_stats()
    assert type(one.executor) is OffloadExecutor and type(one.cache).__name__ == "KVCache"
    three = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                        gpu_budget=_budgets_holding(four_layers, (1, 2, 3), ("cpu",) * 3), devices=("cpu",) * 3)
    assert len(set(three.model.spread.device_of_layer)) == 3 and three.device_plan.crossings() == 2
    assert _generate(three) == _generate(one)


def test_out_of_memory_halves_every_devices_resident_experts(four_layers):
    engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=_budgets_holding(four_layers, (4, 6)), devices=("cpu", "cpu"))
    assert engine._on_oom()
    assert [d["experts_on_gpu"] for d in engine.expert_stats()["devices"]] == [2, 3]
    assert any("GPU out of memory while generating" in w for w in engine.warnings)


def test_out_of_memory_is_retried_where_only_a_later_device_keeps_experts(four_layers):
    # The retry asks whether experts can move: the second GPU's count, though the first keeps none.
    engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=_budgets_holding(four_layers, (0, 4)), devices=("cpu", "cpu"))
    assert [d["experts_on_gpu"] for d in engine.expert_stats()["devices"]] == [0, 4]
    assert engine._can_free() and engine._on_oom()
    assert [d["experts_on_gpu"] for d in engine.expert_stats()["devices"]] == [0, 2]


def test_a_dense_model_with_several_figures_runs_on_one_device_and_says_so(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("llama")), device="cpu", dtype="float32", context_length=64,
                         gpu_budget=(1.0, 1.0), devices=("cpu", "cpu"))
    assert engine.model.spread is None
    assert any("runs on cpu alone" in w for w in engine.warnings)


def test_device_executors_read_as_one_models_executor():
    from moedesk.kernels.expert_weights import ExpertWeights

    def bank():
        w = ExpertWeights.empty(3, 8, 4, dtype=torch.float32)
        w.gate_up.normal_(), w.down.normal_()
        return w

    selections: dict = {}
    first = OffloadExecutor({0: bank(), 1: bank()}, [[False] * 3] * 2, "cpu", lambda loads: (sorted(loads), []),
                            selections=selections)
    second = OffloadExecutor({2: bank()}, [[False] * 3], "cpu", lambda loads: (sorted(loads), []),
                             selections=selections)
    both = DeviceExecutors([first, second], [[0, 1], [2]])
    both.set_placement([[True, False, False], [False, False, False], [False, True, True]])
    assert first.on_gpu() == [[True, False, False], [False] * 3] and second.on_gpu() == [[False, True, True]]
    assert both.on_gpu() == first.on_gpu() + second.on_gpu()

    class Moe:
        def __init__(self, layer):
            self.layer = layer

    x, ids = torch.randn(2, 8), torch.tensor([[0, 1], [1, 2]])
    for layer in (0, 2):
        torch.testing.assert_close(both.expert_outputs(Moe(layer), x, ids),
                                   both.of[layer].expert_outputs(Moe(layer), x, ids))
    assert sorted(both.selections) == [0, 2] and both.selections[2].tolist() == [2, 4, 2]
    assert both.stats.selections == 16 and both.stats.gpu_hits == 2 * (1 + 3)  # each layer ran twice
    both.stats = StepStats()
    assert both.stats.selections == 0
    both.selections.clear()
    assert not first.selections and not second.selections


@pytest.mark.gpu
def test_two_cuda_devices_give_one_gpus_greedy_text(four_layers):
    """On the two-GPU box: each GPU holds its layers and its own resident experts, decode replays CUDA graphs on
    each, and the greedy text is transformers' on one GPU, token for token."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    budgets = _budgets_holding(four_layers, (3, 5))  # the same bytes on a GPU: float32 both
    engine = Engine.load(str(four_layers), device="cuda", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cuda:0", "cuda:1"))
    assert [d.type for d in engine.model.spread.devices] == ["cuda", "cuda"]
    parts = engine.executor.executors
    assert [e.device for e in parts] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for executor in parts:
        assert {bank.gpu.gate_up.device for bank in executor.banks.values() if bank.gpu is not None} == {
            executor.device}
    assert [block.attn_norm.weight.device.index for block in engine.model.layers] == [0, 0, 1, 1]
    assert engine.runner.graphs is not None and not any("CUDA graphs are off" in w for w in engine.warnings)
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    ref = hf_model(four_layers, torch.float32, "cuda")  # as tests/model/test_gpu_equivalence.py checks one GPU
    assert _generate(engine) == [hf_greedy(ref, engine.tokenizer.encode(p), GREEDY.max_new_tokens, eos)
                                 for p in PROMPTS]
    assert [d["experts_on_gpu"] for d in engine.expert_stats()["devices"]] == [3, 5]
    # Decode replayed CUDA graphs captured on both GPUs (engine.generation.cuda_graphs, a pool per device).
    assert any(len(c.pool or ()) == 2 and c.graphs for c in engine.runner.graphs.captured.values())
    (a, b, link), = engine.device_links  # the one cut, timed on the real link
    assert (a, b) == (0, 1) and link["gbs"] > 1 and any(line.startswith("  cut GPU 0 -> GPU 1: ")
                                                         for line in engine.device_plan_lines())


def test_a_figure_too_small_for_its_layers_is_one_line_naming_the_gpu(four_layers):
    from moedesk.engine.errors import MoedeskError

    with pytest.raises(MoedeskError) as refused:
        Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                    gpu_budget=(1.0, 0.0001), devices=("cpu", "cpu"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("GPU 1's budget") and "raise its figure in --gpu-budget" in message


def test_a_link_is_timed_as_a_tokens_copy_and_a_bandwidth():
    from moedesk.engine.offload.profiler import device_link

    link = device_link("cpu", "cpu", 64, torch.float32, megabytes=4, repeat=3)
    assert link["token_ms"] > 0 and link["gbs"] > 0


def test_with_the_expert_cache_each_device_places_the_experts_its_plan_chose(four_layers, monkeypatch):
    """MOEDESK_EXPERT_CACHE=1: the per-device plan prices whole layers as each device's own placement does (the
    cache starts from that placement, engine.offload.orchestration.ExpertOrchestra.place), so what a device holds is
    what the plan, and `moedesk profile`'s lines from it, say."""
    monkeypatch.setenv("MOEDESK_EXPERT_CACHE", "1")
    for held in ((3, 5), (4, 6), (2, 7)):
        engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                             gpu_budget=_budgets_holding(four_layers, held), devices=("cpu", "cpu"))
        assert all(part.cache is not None for part in engine.orchestra.parts)
        plan = engine.device_plan
        assert [e.on_gpu() for e in engine.executor.executors] == [p.on_gpu.tolist() for p in plan.placements], held
