"""The llama.cpp engine on several GPUs (issue 45, item 3): llama.cpp spreads its layers over every GPU it sees, so
the fit counts them all (their free memory together, a compute buffer on each), and the load tells llama.cpp how
many layers each takes by bytes: its own split counts layers by free memory, and a layer whose experts stay in RAM
is a small one. One GPU named `--device cuda:N` is llama.cpp's alone: its free memory is the fit's, and the load
asks for llama.cpp's single-GPU mode on it."""
import pytest

from moedesk.engine.llamacpp import engine as llama_engine
from moedesk.engine.llamacpp import fit as fit_module
from moedesk.engine.llamacpp.fit import Machine, gpu_split, plan
from moedesk.engine.llamacpp.placement import GIB, Placement, layer_split

llama_cpp = pytest.importorskip("llama_cpp")
from tests.llamacpp.test_compute_buffer import CONTEXT, LAYERS, mixtral_8l_q4_k_m  # noqa: E402


def test_layers_follow_each_gpus_share_of_the_room():
    assert layer_split([1] * 8, [10, 10]) == (4, 4)
    assert layer_split([1] * 8, [30, 10]) == (6, 2)
    assert layer_split([1] * 9, [7]) == (9,)
    assert layer_split([1] * 4, [0, 0]) == (2, 2)  # nothing known: even
    # the first four layers' experts in RAM: GPU 0 takes them and two more, not half the count
    assert layer_split([1, 1, 1, 1, 5, 5, 5, 5, 1], [10, 10]) == (6, 3)
    assert layer_split([], [10, 10]) == (0, 0)


def test_two_gpus_hold_what_one_of_them_could_not():
    shape = mixtral_8l_q4_k_m()
    one = plan(shape, Machine(True, 4 * GIB, 64 * GIB), CONTEXT)
    two = plan(shape, Machine(True, 8 * GIB, 64 * GIB, (4 * GIB, 4 * GIB)), CONTEXT)
    assert two.placement.cpu_moe < one.placement.cpu_moe  # the second card's room used
    # and a compute buffer on each GPU, where one GPU keeps one
    alone = plan(shape, Machine(True, 8 * GIB, 64 * GIB), CONTEXT, cpu_moe=two.placement.cpu_moe)
    assert two.compute_bytes > alone.compute_bytes


def test_the_split_puts_the_layers_whose_experts_stay_in_ram_with_more_of_the_rest():
    shape = mixtral_8l_q4_k_m()
    machine = Machine(True, 8 * GIB, 64 * GIB, (4 * GIB, 4 * GIB))
    fit = plan(shape, machine, CONTEXT)
    pinned = fit.placement.cpu_moe
    assert 0 < pinned < LAYERS
    split = gpu_split(shape, fit.placement, machine, fit.context)
    assert sum(split) == LAYERS + 1  # the layers, then the output layer
    assert split[0] > (LAYERS + 1) // 2  # llama.cpp's count by free memory would give each GPU half
    assert gpu_split(shape, fit.placement, Machine(True, 8 * GIB, 64 * GIB), fit.context) is None  # one GPU
    everything_in_ram = Placement(0, LAYERS, LAYERS, 0, "")
    assert gpu_split(shape, everything_in_ram, machine, fit.context) is None


def test_this_machine_sees_every_gpu(monkeypatch):
    monkeypatch.setattr(fit_module, "llama_gpu", lambda: (True, 40 * GIB))
    monkeypatch.setattr(fit_module, "gpus_free", lambda: (24 * GIB, 16 * GIB))
    assert fit_module.this_machine("auto", 1).gpus == (24 * GIB, 16 * GIB)
    assert fit_module.this_machine("cpu", 1) == Machine(False, 40 * GIB, 1)
    monkeypatch.setattr(fit_module, "gpus_free", lambda: (40 * GIB,))
    assert fit_module.this_machine("auto", 1) == Machine(True, 40 * GIB, 1)  # one GPU: as before


def test_the_load_hands_llama_cpp_the_split():
    seen = []
    lib = fake_lib(lambda params: seen.append([params.tensor_split[i] for i in range(2)] if params.tensor_split
                                              else None))
    placement = Placement(gpu_layers=9, cpu_moe=0, layers=8, expert_bytes_in_ram=0, why="")
    llama_engine._load_file(lib, "x.gguf", placement, None, (6, 3))
    llama_engine._load_file(lib, "x.gguf", placement, None)
    assert seen == [[6.0, 3.0], None]  # without one, llama.cpp's own split (a NULL tensor_split)


def test_a_named_gpu_is_the_fit_s_alone(monkeypatch):
    # --device cuda:N: llama.cpp is given that GPU alone, so its free memory is all the fit may spend
    from moedesk.engine.errors import MoedeskError

    assert [fit_module.named_gpu(d) for d in ("cuda:1", "cuda:0", "cuda", "auto", "cpu")] == [1, 0, None, None, None]
    monkeypatch.setattr(fit_module, "llama_gpu", lambda: (True, 40 * GIB))
    monkeypatch.setattr(fit_module, "gpus_free", lambda: (24 * GIB, 16 * GIB))
    assert fit_module.this_machine("cuda:1", 1) == Machine(True, 16 * GIB, 1, (), 1)
    assert fit_module.this_machine("cuda:0", 1) == Machine(True, 24 * GIB, 1, (), 0)
    assert fit_module.this_machine("cuda", 1) == Machine(True, 40 * GIB, 1, (24 * GIB, 16 * GIB))  # every GPU
    assert fit_module.this_machine("cpu", 1) == Machine(False, 40 * GIB, 1)
    with pytest.raises(MoedeskError, match=r"--device cuda:2: no such GPU here \(cuda:0 to cuda:1\)"):
        fit_module.this_machine("cuda:2", 1)
    # and what the plan spends is that GPU's room: no spread, one compute buffer
    shape = mixtral_8l_q4_k_m()
    one = plan(shape, fit_module.this_machine("cuda:1", 64 * GIB), CONTEXT)
    assert one == plan(shape, Machine(True, 16 * GIB, 64 * GIB), CONTEXT)
    assert gpu_split(shape, one.placement, fit_module.this_machine("cuda:1", 64 * GIB), one.context) is None


def fake_lib(record):
    """A library whose model load hands `record` the params llama.cpp would be given, and loads nothing."""
    from moedesk.engine.llamacpp.library import library

    lib = library()

    def load(path, params):
        record(params)
        return None

    class Api:
        def __getattr__(self, name):
            return getattr(lib.api, name)

        llama_model_load_from_file = staticmethod(load)

    class Lib:
        api = Api()

        def cpu_buffer_type(self):
            return lib.cpu_buffer_type()

    return Lib()


def test_the_load_gives_llama_cpp_the_named_gpu_alone():
    seen, none, layer = [], llama_cpp.LLAMA_SPLIT_MODE_NONE, llama_cpp.LLAMA_SPLIT_MODE_LAYER
    lib = fake_lib(lambda params: seen.append((params.split_mode, params.main_gpu, bool(params.devices))))
    placement = Placement(gpu_layers=9, cpu_moe=0, layers=8, expert_bytes_in_ram=0, why="")
    llama_engine._load_file(lib, "x.gguf", placement, None, None, 1)
    llama_engine._load_file(lib, "x.gguf", placement, None)  # "cuda", "auto": every GPU, llama.cpp's default
    llama_engine._load_file(lib, "x.gguf", Placement(0, 8, 8, 0, ""), None, None, 1)  # nothing offloaded: no device
    assert seen == [(none, 1, False), (layer, 0, False), (layer, 0, True)]


def test_the_engine_loads_on_the_gpu_its_machine_names(tmp_path, monkeypatch):
    from moedesk.engine.errors import CheckpointError
    from tests.gguf_from_hf import build

    path = build("qwen3moe", tmp_path / "q").gguf
    monkeypatch.setattr(llama_engine, "this_machine",
                        lambda device="auto": Machine(True, 8 * GIB, 64 * GIB, (), fit_module.named_gpu(device)))
    given = []

    def load_file(lib, gguf, placement, progress, split=None, gpu=None, extra_buffers=True):
        given.append((split, gpu))
        return None, []

    monkeypatch.setattr(llama_engine, "_load_file", load_file)
    for device in ("cuda:1", "cuda"):
        with pytest.raises(CheckpointError):
            llama_engine.LlamaCppEngine.load(str(path), device=device, context_length=256)
    assert given == [(None, 1), (None, None)]
