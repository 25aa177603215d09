"""Over several devices each layer's non-expert weights are put straight on its own device as they are read, never
first on the first device and moved (issue 45: "the first GPU briefly holds all non-expert weights during load").

The CPU listed twice cannot tell one device from the other, so on the CPU the second device is the meta device: a
tensor put there has a device of its own, and what the loader put where is recorded at the one call that places each
weight (engine.load.loader._set_parameter). On two CUDA GPUs (`pytest -m gpu`), the first GPU's peak memory during the
load says the same."""
from __future__ import annotations

import pytest
import torch

import moedesk.engine.load.loader as loader
from moedesk.engine.runtime import Engine
from tests.offload.test_device_orchestra import _budgets_holding
from tests.tiny_models import build


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build("mixtral", tmp_path_factory.mktemp("mixtral4"), num_hidden_layers=4)


def record_placements(monkeypatch) -> dict[str, list[torch.device]]:
    """Every device each parameter was put on by the loader, in order."""
    placed: dict[str, list[torch.device]] = {}
    real = loader._set_parameter

    def spy(model, name, tensor):
        placed.setdefault(name, []).append(tensor.device)
        return real(model, name, tensor)

    monkeypatch.setattr(loader, "_set_parameter", spy)
    return placed


def expected_device(name: str, owner: tuple[int, ...], devices: list[torch.device]) -> torch.device:
    part, _, rest = name.partition(".")
    if part == "layers":
        return devices[owner[int(rest.split(".")[0])]]
    return devices[owner[-1]] if part in ("norm", "lm_head") else devices[0]


def test_each_layers_weights_go_straight_to_its_device(four_layers, monkeypatch):
    budgets = _budgets_holding(four_layers, (3, 5))
    placed = record_placements(monkeypatch)
    # Past the load, the orchestras would profile and calibrate on the meta device: what is tested is done by then.
    monkeypatch.setattr(Engine, "_orchestrate_devices", lambda self, *args: None)
    engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cpu", "meta"))
    owner = engine.model.spread.device_of_layer
    assert owner == (0, 0, 1, 1)
    devices = [torch.device("cpu"), torch.device("meta")]
    assert placed and all(len(where) == 1 for where in placed.values())  # each weight placed once
    wrong = {name: where[0] for name, where in placed.items() if where[0] != expected_device(name, owner, devices)}
    assert not wrong, wrong
    assert {name.split(".")[1] for name, where in placed.items() if where[0].type == "meta" and
            name.startswith("layers.")} == {"2", "3"}
    # and nothing was moved afterwards: every weight is where it was first put
    for name, parameter in engine.model.named_parameters():
        if name in placed:
            assert parameter.device == placed[name][0], name


@pytest.mark.gpu
def test_the_first_gpu_never_holds_the_second_gpus_weights(four_layers, monkeypatch):
    """On two CUDA GPUs: every weight is first put on its own GPU, and cuda:0's peak during the load stays below
    what it holds plus the second GPU's layers (what it reached when every weight went through it)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    budgets = _budgets_holding(four_layers, (3, 5))
    placed = record_placements(monkeypatch)
    # The peak while the weights are read: before the experts' orchestration, whose profile times copies between
    # the GPUs with buffers of its own.
    peak, orchestrate = [], Engine._orchestrate_devices
    monkeypatch.setattr(Engine, "_orchestrate_devices",
                        lambda self, *a: (peak.append(torch.cuda.max_memory_allocated(0)), orchestrate(self, *a)))
    # What earlier tests left allocated on cuda:0 stays in its peak: the load's own rise is measured above it.
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    engine = Engine.load(str(four_layers), device="cuda", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cuda:0", "cuda:1"))
    owner = engine.model.spread.device_of_layer
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    wrong = {name: where[0] for name, where in placed.items() if where[0] != expected_device(name, owner, devices)}
    assert not wrong, wrong
    second = sum(p.numel() * p.element_size() for name, p in engine.model.named_parameters()
                 if expected_device(name, owner, devices).index == 1)
    first = sum(p.numel() * p.element_size() for name, p in engine.model.named_parameters()
                if p.device.index == 0)
    assert second > 0 and len(peak) == 1 and peak[0] - before < first + second


def test_a_tied_head_is_read_onto_the_last_layers_device_not_copied_from_the_first(tmp_path, monkeypatch):
    """A model whose output head is its embedding table (tie_word_embeddings): over two devices the table stays on
    the first and the head is put once, from the checkpoint, straight on the last layer's device (before, the
    spread copied it there from the first device's table). Where both are one device it stays the table itself."""
    tied = build("mixtral", tmp_path / "tied", num_hidden_layers=4, tie_word_embeddings=True)
    budgets = _budgets_holding(tied, (3, 5))
    monkeypatch.setattr(Engine, "_orchestrate_devices", lambda self, *args: None)
    placed = record_placements(monkeypatch)
    engine = Engine.load(str(tied), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cpu", "meta"))
    assert engine.config.tie_word_embeddings and engine.model.spread.device_of_layer == (0, 0, 1, 1)
    assert placed["embed.weight"] == [torch.device("cpu")]
    assert placed["lm_head.weight"] == [torch.device("meta")]  # put once, where the last layers are
    head, table = engine.model.lm_head.weight, engine.model.embed.weight
    assert head.device.type == "meta" and table.device.type == "cpu"
    assert head.shape == table.shape and head.dtype == table.dtype

    placed.clear()
    engine = Engine.load(str(tied), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cpu", "cpu"))
    assert engine.model.lm_head.weight is engine.model.embed.weight and "lm_head.weight" not in placed


@pytest.mark.gpu
def test_a_tied_head_on_two_gpus_is_read_onto_the_second_and_decodes_as_on_one(tmp_path, monkeypatch):
    """On two CUDA GPUs: a tied model's table stays on cuda:0 and its head is put once on cuda:1, straight from the
    checkpoint; greedy ids equal the one-GPU load's."""
    from moedesk.engine.requests import Request, SamplingParams

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    tied = build("mixtral", tmp_path / "tied", num_hidden_layers=4, tie_word_embeddings=True)

    def greedy(engine):
        return engine.complete([Request(engine.tokenizer.encode("The sea is"),
                                        SamplingParams(max_new_tokens=8, temperature=0))])[0].token_ids

    one = Engine.load(str(tied), device="cuda", dtype="float32", context_length=64)
    expected = greedy(one)
    del one
    budgets = _budgets_holding(tied, (3, 5))  # its probe load is not the one whose placements are recorded
    placed = record_placements(monkeypatch)
    two = Engine.load(str(tied), device="cuda", dtype="float32", offload=True, context_length=64,
                      gpu_budget=budgets, devices=("cuda:0", "cuda:1"))
    assert placed["embed.weight"] == [torch.device("cuda", 0)] and placed["lm_head.weight"] == [torch.device("cuda", 1)]
    assert greedy(two) == expected
