"""The tensor-override path: a tiny MoE GGUF (written with the gguf package, quantised by llama.cpp's quantiser)
loaded with N layers' experts pinned to the CPU buffer has exactly those tensors overridden, as llama.cpp's load
log says while it applies them, has them in the CPU's buffers as ggml's API reads back from the tensors its graph
computes with (on the GPU: the other layers' experts in the GPU's), and gives the same greedy text as without the
override."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.load.test_packed_experts import write_f32_moe

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    write_f32_moe(folder / "f32.gguf", "llama", L=3)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = 2, 1  # Q4_0
    assert llama_cpp.llama_model_quantize(str(folder / "f32.gguf").encode(), str(folder / "q4_0.gguf").encode(),
                                          ctypes.byref(params)) == 0
    return folder / "q4_0.gguf"


class Node(ctypes.Structure):
    """ggml.h's `struct ggml_tensor` up to its sources (GGML_MAX_OP_PARAMS 64 bytes, GGML_MAX_SRC 10)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10)]


class ExpertBuffers:
    """An eval callback that asks for no node but, offered each, notes the buffer type of every routed-expert
    tensor the node reads: {tensor name: (buffer type name, its device a CPU)}. (Not "a host buffer": the CPU's
    repacked Q4_0 is not readable as stored, so ggml does not call it one.) It reads the nodes' headers only,
    which ggml keeps in host memory wherever the data is."""

    def __init__(self, api, ggml):
        p = ctypes.c_void_p
        for name, restype, argtypes in (("ggml_backend_buffer_get_type", p, [p]),
                                        ("ggml_backend_buft_get_device", p, [p]),
                                        ("ggml_backend_buft_is_host", ctypes.c_bool, [p])):
            getattr(ggml, name).restype, getattr(ggml, name).argtypes = restype, argtypes
        self.ggml, self.found, self.user_data = ggml, {}, None
        self.callback = api.ggml_backend_sched_eval_callback(self._on_node)

    def begin_step(self, prefill: bool) -> int:
        """As ExpertCounter's, which LlamaContext calls before each step: every step is looked at."""
        return 1

    def _on_node(self, tensor, ask, user_data) -> bool:
        for src in Node.from_address(tensor).src:
            name = self.ggml.ggml_get_name(src) if src else b""
            buffer = Node.from_address(src).buffer if b"_exps." in name else None
            if buffer:
                buft = self.ggml.ggml_backend_buffer_get_type(buffer)
                device = self.ggml.ggml_backend_buft_get_device(buft)
                # ggml-base's own CPU buffer types ("CPU", and "CPU_Mapped" over an mmapped file) have no device
                # (a FIXME in ggml-backend.cpp), and ggml_backend_dev_type(NULL) aborts the process.
                # A GPU backend's page-locked host memory (CUDA_Host) has the GPU as its device: RAM all the same.
                on_cpu = (not device or self.ggml.ggml_backend_dev_type(device) == 0  # GGML_BACKEND_DEVICE_TYPE_CPU
                          or self.ggml.ggml_backend_buft_is_host(buft))
                self.found[name.decode()] = (self.ggml.ggml_backend_buft_name(buft).decode(), on_cpu)
        return False


def expert_buffers(engine) -> dict[str, tuple[str, bool]]:
    """Where the engine's model keeps each routed-expert tensor, read back through ggml's API: a context of its own
    over the same weights runs one step with an ExpertBuffers callback."""
    from moedesk.engine.llamacpp.decoder import LlamaContext
    from moedesk.engine.llamacpp.library import library

    probe = ExpertBuffers(engine.api, library().ggml)
    context = LlamaContext(engine.api, engine._model, 64, 1, 64, 1, engine.device.type == "cuda", counter=probe)
    try:
        # A few tokens: from 32 on, llama.cpp copies experts kept in RAM to the GPU for the op (the node then reads
        # the copy).
        context.run([(0, engine.tokenizer.encode("the quick brown fox"), 0, True)])
    finally:
        context.close()
    return probe.found


def load(path, cpu_moe, device="cpu"):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Engine.load(str(path), engine="llama.cpp", device=device, context_length=64, cpu_moe=cpu_moe)
    finally:
        torch.set_num_threads(before)


def greedy(engine):
    ids = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    return engine.complete([Request(ids, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))])[0].token_ids


def test_pinned_layers_experts_are_overridden_and_the_text_is_the_same(tiny_moe):
    plain = load(tiny_moe, cpu_moe=0)
    assert plain.overridden == {}
    expected = greedy(plain)
    plain.close()
    pinned = load(tiny_moe, cpu_moe=2)
    assert set(pinned.overridden) == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down")}
    assert all(buffer.startswith("CPU") for buffer in pinned.overridden.values())  # CPU, or its repacked form
    found = expert_buffers(pinned)
    assert set(found) == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(3) for p in ("gate", "up", "down")}
    # the buffer type named, or with the file memory-mapped and nothing repacked, its mapped form (CPU_Mapped)
    assert all(found[name][0].startswith(buffer) and found[name][1] for name, buffer in pinned.overridden.items())
    assert greedy(pinned) == expected
    pinned.close()


def test_experts_in_ggmls_plain_cpu_buffers_read_back_as_on_the_cpu(tiny_moe):
    """F32 experts are not repacked: pinned, they stay in ggml's mmapped CPU buffer, whose type has no device (so
    are a GPU load's pinned experts): reading them back must not abort."""
    pinned = load(tiny_moe.with_name("f32.gguf"), cpu_moe=2)
    assert set(pinned.overridden) == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down")}
    found = expert_buffers(pinned)
    pinned.close()
    assert set(found) == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(3) for p in ("gate", "up", "down")}
    assert all(buffer.startswith("CPU") and on_cpu for buffer, on_cpu in found.values()), found


def test_with_no_layer_offloaded_llama_cpp_is_given_no_gpu_device(tiny_moe, monkeypatch):
    """--device cpu (or a machine without a GPU) hands llama.cpp an empty device list, as its `--device none` does: a
    CUDA build then neither computes large batches on the GPU nor keeps the weights in RAM in its pinned memory.
    With a GPU (faked here), the default: NULL, every GPU."""
    import moedesk.engine.llamacpp.engine as llama_engine
    from moedesk.engine.llamacpp.fit import Machine
    from moedesk.engine.llamacpp.library import library

    api, given = library().api, []
    real = api.llama_model_load_from_file

    def load_from_file(path, params):
        devices, step = [], ctypes.sizeof(ctypes.c_void_p)
        while params.devices and (entry := ctypes.c_void_p.from_address(params.devices + step * len(devices)).value):
            devices.append(entry)
        given.append(devices if params.devices else None)
        return real(path, params)

    monkeypatch.setattr(api, "llama_model_load_from_file", load_from_file)
    load(tiny_moe, cpu_moe=1).close()
    monkeypatch.setattr(llama_engine, "this_machine", lambda device="auto": Machine(True, 8 * 2**30, 64 * 2**30))
    offloaded = load(tiny_moe, cpu_moe=1, device="auto")
    assert offloaded.placement.gpu_layers > 0
    offloaded.close()
    assert given == [[], None]


@pytest.mark.gpu
def test_on_a_cuda_build_device_cpu_leaves_the_gpu_alone(tiny_moe):
    """Every buffer llama.cpp makes for a --device cpu load is the CPU's: no compute buffer on the GPU (nothing
    computes there) and no weights in its pinned host memory."""
    from moedesk.engine.llamacpp.buffers import in_ram, llama_buffers
    from moedesk.engine.llamacpp.library import library

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    mark = library().log_mark()
    engine = load(tiny_moe, cpu_moe=2)
    buffers = llama_buffers(library().log_since(mark))
    engine.close()
    assert ("CPU", "compute") in buffers and all(in_ram(where) for where, _ in buffers), buffers


@pytest.mark.gpu
def test_on_the_gpu_pinned_layers_stay_in_ram_and_the_rest_go_to_the_gpu(tiny_moe):
    from moedesk.engine.llamacpp.buffers import in_ram

    pinned = load(tiny_moe, cpu_moe=1, device="auto")
    assert pinned.device.type == "cuda", "llama-cpp-python without CUDA: " + " / ".join(pinned.warnings)
    assert set(pinned.overridden) == {f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
    on_gpu, _ = pinned.expert_map()
    assert [all(row) for row in on_gpu] == [False, True, True]
    found = expert_buffers(pinned)  # read back: the pinned layer's experts in RAM, the others in the GPU's memory
    assert {name: on_cpu for name, (_, on_cpu) in found.items()} == {
        f"blk.{i}.ffn_{p}_exps.weight": i == 0 for i in range(3) for p in ("gate", "up", "down")}
    # What the load says it kept them in is what they are in: RAM, the GPU's page-locked memory (CUDA_Host: the
    # file read, not mapped, so that a prefill copies them at the link's speed) or a CPU buffer of the CPU's own
    assert pinned.overridden and all(found[name][0].startswith(buffer) and in_ram(buffer)
                                     for name, buffer in pinned.overridden.items()), (pinned.overridden, found)
    split = greedy(pinned)
    pinned.close()
    whole = greedy(load(tiny_moe, cpu_moe=0, device="auto"))  # every expert on the GPU
    # The pinned layer's experts compute on the CPU (other arithmetic than CUDA's): most tokens agree.
    assert sum(a == b for a, b in zip(split, whole)) >= 12


def test_profile_on_llama_cpp_says_which_engine_and_where_each_layers_experts_are(tiny_moe, capsys, monkeypatch):
    from moedesk.app.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["profile", "--engine", "llama.cpp", "--model", str(tiny_moe), "--device", "cpu",
                 "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "engine: llama.cpp engine, as asked" in out and "on llama.cpp, no GPU for llama.cpp: all in RAM" in out
    assert "placement per layer" in out and "0 of 12 experts on the GPU" in out
    # the three layers placed alike, in one line
    assert [line.strip() for line in out.splitlines() if line.strip().startswith("layer")] == ["layers   0-2:   ...."]


def test_the_load_reports_progress_and_a_progress_that_raises_cancels_it(tiny_moe):
    seen = []

    def progress(phase, fraction):
        seen.append((phase, fraction))

    engine = Engine.load(str(tiny_moe), engine="llama.cpp", device="cpu", context_length=64, progress=progress)
    engine.close()
    fractions = [f for phase, f in seen if phase == "load"]
    assert len(fractions) > 2 and fractions == sorted(fractions) and fractions[-1] == 1.0

    class Cancelled(Exception):
        pass

    def cancel(phase, fraction):
        if fraction > 0:
            raise Cancelled()

    with pytest.raises(Cancelled):
        Engine.load(str(tiny_moe), engine="llama.cpp", device="cpu", context_length=64, progress=cancel)


def test_several_gpu_budgets_are_one_line_on_llama_cpp(tiny_moe, capsys, monkeypatch):
    """Per-GPU budgets are planned for the native engine only (engine.offload.devices): llama.cpp says so."""
    import moedesk.engine.hardware as hardware
    from moedesk.app.cli import main

    monkeypatch.setattr(hardware, "cuda_device_count", lambda: 2)
    assert main(["profile", "--engine", "llama.cpp", "--model", str(tiny_moe), "--device", "cpu",
                 "--gpu-budget", "1,1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the llama.cpp engine takes one figure" in err
