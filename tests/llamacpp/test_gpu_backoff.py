"""When llama.cpp cannot allocate its GPU buffers for the placement the plan chose, the load keeps half the GPU's
expert layers in RAM and loads again, with a line that says so (engine.llamacpp.engine.LlamaCppEngine.load), as the
native engine backs off on the GPU's out-of-memory. Here the machine has a GPU (faked) and llama.cpp's first load
fails as CUDA's does, in its own log's words; the second is real."""
from __future__ import annotations

import pytest

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.llamacpp.fit import Machine
from moedesk.engine.llamacpp.placement import GIB
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CUDA_OOM = [b"ggml_backend_cuda_buffer_type_alloc_buffer: allocating 3000.00 MiB on device 0: cudaMalloc failed: "
            b"out of memory\n", b"alloc_tensor_range: failed to allocate CUDA0 buffer of size 3145728000\n",
            b"llama_model_load: error loading model: unable to allocate CUDA0 buffer\n"]


def greedy(engine) -> list[int]:
    request = Request([5, 17, 33, 2], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    return engine.complete([request])[0].token_ids


def test_a_gpu_that_cannot_hold_the_planned_experts_keeps_half_of_them_in_ram_and_loads(tmp_path, monkeypatch):
    import moedesk.engine.llamacpp.engine as llama_engine

    path = build("qwen3moe", tmp_path / "q").gguf
    monkeypatch.setattr(llama_engine, "this_machine", lambda device="auto": Machine(True, 8 * GIB, 64 * GIB))
    real, tried = llama_engine._load_file, []

    def load_file(lib, gguf, placement, progress, split=None, gpu=None, extra_buffers=True):
        tried.append(placement.cpu_moe)
        if len(tried) == 1:  # what llama.cpp's CUDA backend logs when the model buffer does not fit
            for line in CUDA_OOM:
                lib._log(4, line, None)
            return None, []
        return real(lib, gguf, placement, progress)

    monkeypatch.setattr(llama_engine, "_load_file", load_file)
    engine = Engine.load(str(path), engine="llama.cpp", context_length=256, gpu_budget=4)
    try:
        assert tried == [0, 2]  # every expert on the GPU as planned, then the first two of four layers' in RAM
        assert engine.placement.cpu_moe == 2 and "the GPU could not hold more" in engine.placement.why
        assert any(w.startswith("llama.cpp could not allocate its GPU buffers") for w in engine.warnings)
        pinned = {name for name, where in engine.overridden.items() if where.startswith("CPU")}
        assert pinned == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down")}
        backed_off = greedy(engine)
    finally:
        engine.close()
    monkeypatch.setattr(llama_engine, "_load_file", real)
    pinned = Engine.load(str(path), engine="llama.cpp", context_length=256, cpu_moe=2)
    try:
        assert len(backed_off) == 6 and greedy(pinned) == backed_off  # as if -ncmoe 2 had been asked
    finally:
        pinned.close()


def test_no_back_off_is_left_once_every_expert_is_in_ram(tmp_path, monkeypatch):
    """A GPU that cannot hold even the rest: the load stops with llama.cpp's own error line, not a loop."""
    import moedesk.engine.llamacpp.engine as llama_engine
    from moedesk.engine.errors import MoedeskError

    path = build("qwen3moe", tmp_path / "q").gguf
    monkeypatch.setattr(llama_engine, "this_machine", lambda device="auto": Machine(True, 8 * GIB, 64 * GIB))
    tried = []

    def load_file(lib, gguf, placement, progress, split=None, gpu=None, extra_buffers=True):
        tried.append(placement.cpu_moe)
        for line in CUDA_OOM:
            lib._log(4, line, None)
        return None, []

    monkeypatch.setattr(llama_engine, "_load_file", load_file)
    with pytest.raises(MoedeskError, match="llama.cpp could not load this file: .*unable to allocate CUDA0 buffer"):
        Engine.load(str(path), engine="llama.cpp", context_length=256, gpu_budget=4)
    assert tried == [0, 2, 3, 4]
