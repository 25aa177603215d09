"""When llama.cpp loads the model but cannot make its context (KV cache or compute buffer) on the GPU, the load frees
the model and loads again with at least one more layer's experts in RAM, as many as the failed buffer asked for, and,
once none are left on the GPU, with the KV cache in RAM where that frees as much (engine.llamacpp.engine.
LlamaContext's load loop), saying so in one line. Here the machine has a GPU (faked) and llama.cpp's context fails as
CUDA's does, in its own log's words, where tests/llamacpp/test_gpu_backoff.py fails the model's load; the model loads
are real, and the last context too. Also: the other failures of llama.cpp after a load (a failed decode, no logits, a
context that cannot be made again) give one line, and the engine goes on."""
from __future__ import annotations

import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.llamacpp.buffers import failed_gpu_bytes
from moedesk.engine.llamacpp.fit import FIRST_SLOTS, Machine, cache_cells, gguf_shape, read_header
from moedesk.engine.llamacpp.placement import GIB, GGUFSizes, Placement, context_backed_off
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONTEXT = 256


def cuda_context_oom(size: int, what: str) -> list[bytes]:
    """What llama.cpp's CUDA backend and context log when a KV cache ("kv") or compute buffer does not fit."""
    failed = (f"alloc_tensor_range: failed to allocate CUDA0 buffer of size {size}\n" if what == "kv" else
              f"ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size {size}\n")
    why = "failed to allocate buffer for kv cache" if what == "kv" else "failed to allocate compute pp buffers"
    return [f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {size / 2**20:.2f} MiB on device 0: cudaMalloc "
            f"failed: out of memory\n".encode(), failed.encode(),
            f"llama_init_from_model: failed to initialize the context: {why}\n".encode()]


def greedy(engine) -> list[int]:
    request = Request([5, 17, 33, 2], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    return engine.complete([request])[0].token_ids


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = build("qwen3moe", tmp_path_factory.mktemp("q")).gguf
    return path, gguf_shape(read_header(path))


@pytest.fixture
def faked(monkeypatch):
    """A machine with a GPU, and llama.cpp's contexts failing as `failures` says, one entry an attempt: (size, "kv"
    or "compute") fails it on the GPU, None makes it for real. Returns (failures, attempts): attempts gets
    (experts layers in RAM, KV cache on the GPU) for every context tried."""
    import moedesk.engine.llamacpp.engine as llama_engine

    monkeypatch.setattr(llama_engine, "this_machine", lambda device="auto": Machine(True, 8 * GIB, 64 * GIB))
    real_load, real_context = llama_engine._load_file, llama_engine._make_context
    failures, attempts, pinned = [], [], []

    def load_file(lib, gguf, placement, progress, split=None, gpu=None, extra_buffers=True):
        pinned.append(placement.cpu_moe)
        return real_load(lib, gguf, placement, progress, split, gpu)

    def make_context(api, model, context, slots, batch_tokens, threads, offload_kv, counter):
        attempts.append((pinned[-1], offload_kv))
        failure = failures.pop(0) if failures else None
        if failure is None:
            return real_context(api, model, context, slots, batch_tokens, threads, offload_kv, counter)
        from moedesk.engine.llamacpp.library import library

        for line in cuda_context_oom(*failure):
            library()._log(4, line, None)
        return None

    monkeypatch.setattr(llama_engine, "_load_file", load_file)
    monkeypatch.setattr(llama_engine, "_make_context", make_context)
    return failures, attempts


def direct(path, cpu_moe: int) -> list[int]:
    """Greedy ids of a load asked for the first `cpu_moe` layers' experts in RAM, as `-ncmoe` would be."""
    import moedesk.engine.llamacpp.engine as llama_engine

    engine = llama_engine.LlamaCppEngine.load(str(path), context_length=CONTEXT, cpu_moe=cpu_moe)
    try:
        assert engine.placement.cpu_moe == cpu_moe
        return greedy(engine)
    finally:
        engine.close()


def test_a_context_that_does_not_fit_beside_the_weights_keeps_as_many_more_layers_in_ram_as_it_asked(qwen, faked):
    path, shape = qwen
    layer = shape.sizes.expert_bytes[0]
    assert set(shape.sizes.expert_bytes) == {layer} and len(shape.sizes.expert_bytes) == 4
    failures, attempts = faked
    # The compute buffer first (more than one layer's experts, with the copy the first pinned layer adds), then the
    # KV cache (less than one layer's): two layers' experts, then a third.
    failures += [(layer + layer // 2, "compute"), (layer // 2, "kv"), None]
    engine = Engine.load(str(path), engine="llama.cpp", context_length=CONTEXT, gpu_budget=4)
    try:
        assert attempts == [(0, True), (2, True), (3, True)]
        assert engine.placement.cpu_moe == 3 and engine.llama.offload_kv
        assert engine.placement.why == "experts of 3 of 4 layers in RAM: the GPU could not hold more"
        lines = [w for w in engine.warnings if w.startswith("llama.cpp could not make its context on the GPU")]
        assert lines == ["llama.cpp could not make its context on the GPU; experts of 2 of 4 layers in RAM: the GPU "
                         "could not hold more",
                         "llama.cpp could not make its context on the GPU; experts of 3 of 4 layers in RAM: the GPU "
                         "could not hold more"]
        pinned = {name for name, where in engine.overridden.items() if where.startswith("CPU")}
        assert pinned == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1, 2) for p in ("gate", "up", "down")}
        backed_off = greedy(engine)
    finally:
        engine.close()
    assert len(backed_off) == 6 and backed_off == direct(path, 3)  # as if -ncmoe 3 had been asked


def test_once_every_expert_is_in_ram_the_kv_cache_goes_there_too(qwen, faked):
    path, shape = qwen
    kv = cache_cells(CONTEXT) * shape.kv_per_position
    failures, attempts = faked
    failures += [(kv, "kv")] * 5 + [None]
    engine = Engine.load(str(path), engine="llama.cpp", context_length=CONTEXT, gpu_budget=4)
    try:
        assert attempts == [(0, True), (1, True), (2, True), (3, True), (4, True), (4, False)]
        assert engine.placement.cpu_moe == 4 and not engine.llama.offload_kv
        assert engine.warnings[-1] == ("llama.cpp could not make its context on the GPU; experts of 4 of 4 layers in "
                                       "RAM: the GPU could not hold more; the KV cache in RAM: the GPU could not hold "
                                       "it")
        assert engine.fit.ram_bytes >= kv + sum(shape.sizes.expert_bytes)
        backed_off = greedy(engine)
    finally:
        engine.close()
    assert backed_off == direct(path, 4)


def test_a_hybrid_models_state_leaves_the_gpu_with_its_kv_cache(tmp_path, faked):
    """A recurrent model's state sits where llama.cpp keeps the KV cache: a failed buffer the size of both is what
    moving the cache to RAM frees, so the load goes on rather than stopping."""
    path = build("qwen35moe", tmp_path).gguf
    shape = gguf_shape(read_header(path))
    layers = len(shape.sizes.expert_bytes)
    assert shape.state_per_sequence > 0
    both = FIRST_SLOTS * (cache_cells(CONTEXT) * shape.kv_per_position + shape.state_per_sequence)
    failures, attempts = faked
    failures += [(both, "kv"), None]
    engine = Engine.load(str(path), engine="llama.cpp", context_length=CONTEXT, gpu_budget=4, cpu_moe=layers)
    try:
        assert attempts == [(layers, True), (layers, False)] and not engine.llama.offload_kv
        assert engine.warnings[-1].endswith("the KV cache in RAM: the GPU could not hold it")
        assert len(greedy(engine)) == 6
    finally:
        engine.close()


def test_a_context_that_the_cache_in_ram_would_not_free_enough_for_is_one_line(qwen, faked):
    path, shape = qwen
    failures, attempts = faked
    failures += [(GIB, "compute")]
    with pytest.raises(MoedeskError) as error:
        Engine.load(str(path), engine="llama.cpp", context_length=CONTEXT, gpu_budget=4, cpu_moe=4)
    assert attempts == [(4, True)]  # nothing left to move that would free a GiB: no reload
    assert str(error.value) == (f"llama.cpp could not make a context of {CONTEXT} positions on the GPU with every "
                                f"expert in RAM: llama_init_from_model: failed to initialize the context: failed to "
                                f"allocate compute pp buffers: use a shorter --context")


def test_a_context_that_ram_cannot_hold_is_not_retried(qwen, faked, monkeypatch):
    """A failed CPU buffer: keeping experts in RAM would not help."""
    import moedesk.engine.llamacpp.engine as llama_engine

    path, _ = qwen
    failures, attempts = faked

    def cpu_oom(*args):
        from moedesk.engine.llamacpp.library import library

        attempts.append("cpu")
        for line in (b"ggml_aligned_malloc: insufficient memory (attempted to allocate 36000.00 MB)\n",
                     b"alloc_tensor_range: failed to allocate CPU buffer of size 37748736000\n",
                     b"llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv "
                     b"cache\n"):
            library()._log(4, line, None)
        return None

    monkeypatch.setattr(llama_engine, "_make_context", cpu_oom)
    with pytest.raises(MoedeskError, match=r"^llama.cpp could not make a context of 256 positions: llama_init_from_"
                                           r"model: .*kv cache: use a shorter --context$"):
        Engine.load(str(path), engine="llama.cpp", context_length=CONTEXT, gpu_budget=4)
    assert attempts == ["cpu"]


def test_the_failed_gpu_buffer_is_read_from_the_log_and_cpu_ones_are_not():
    log = [line.decode() for line in cuda_context_oom(1234, "compute") + cuda_context_oom(99, "kv")]
    assert failed_gpu_bytes(log) == 1234
    assert failed_gpu_bytes(["alloc_tensor_range: failed to allocate CPU buffer of size 5000",
                             "ggml_gallocr_reserve_n: failed to allocate CUDA_Host buffer of size 7000"]) is None
    assert failed_gpu_bytes(["llama_init_from_model: failed to initialize the context: failed to allocate buffer "
                             "for kv cache"]) is None


def test_context_back_off_moves_at_least_one_layer_and_as_many_as_asked():
    sizes = GGUFSizes((0, 100, 100, 50, 100), 10)  # layer 0 is dense
    on_gpu = Placement(6, 0, 5, 0, "")
    assert context_backed_off(sizes, on_gpu, 1) == 2  # the dense layer frees nothing: the first with experts
    assert context_backed_off(sizes, on_gpu, 150) == 3
    assert context_backed_off(sizes, on_gpu, 250) == 4
    assert context_backed_off(sizes, on_gpu, 10**9) == 5  # every layer: more could not help, but all moved
    assert context_backed_off(sizes, Placement(6, 3, 5, 200, ""), 10) == 4
    assert context_backed_off(sizes, Placement(6, 5, 5, 350, ""), 10) is None  # none left on the GPU
    assert context_backed_off(sizes, Placement(0, 0, 5, 350, ""), 10) is None  # no GPU


# --- the other failures of llama.cpp after a load ---------------------------------------------------------------

@pytest.fixture
def engine(qwen):
    engine = Engine.load(str(qwen[0]), engine="llama.cpp", context_length=CONTEXT)
    yield engine
    engine.close()


@pytest.mark.parametrize("status, words", [(-2, "out of memory for the computation"), (-3, "the computation failed"),
                                           (-1, "the batch is invalid"), (-7, "error -7")])
def test_a_failed_decode_is_one_line_and_the_next_request_decodes(engine, monkeypatch, status, words):
    expected = greedy(engine)
    real = engine.llama.api.llama_decode
    monkeypatch.setattr(engine.llama.api, "llama_decode", lambda ctx, batch: status)
    with pytest.raises(MoedeskError, match=f"^llama.cpp could not decode a batch of 4 tokens: {words}"):
        greedy(engine)
    monkeypatch.setattr(engine.llama.api, "llama_decode", real)
    assert greedy(engine) == expected


def test_no_logits_from_llama_cpp_is_one_line(engine, monkeypatch):
    import ctypes

    monkeypatch.setattr(engine.llama.api, "llama_get_logits_ith", lambda ctx, i: ctypes.POINTER(ctypes.c_float)())
    with pytest.raises(MoedeskError, match="^llama.cpp gave no logits for token 3 of a batch of 4$"):
        greedy(engine)


def test_a_context_that_cannot_be_made_again_leaves_the_old_one_counting(engine, monkeypatch):
    """Switching expert counting off makes a new context; where llama.cpp gives none, the old one (whose callback
    is the old counter) goes on, counter and all."""
    from moedesk.engine.llamacpp.decoder import NoContext

    expected = greedy(engine)
    counter = engine.llama.counter
    assert counter is not None
    before = counter.snapshot()[0].sum()
    real = engine.llama.api.llama_init_from_model
    monkeypatch.setattr(engine.llama.api, "llama_init_from_model", lambda model, params: None)
    with pytest.raises(NoContext, match="^llama.cpp could not make a context of 1 x 256 positions"):
        engine.count_experts(False)
    assert engine.make_room(4)  # no context for 4, nor 2: the one it has goes on
    assert engine.llama.counter is counter and engine.llama.slots == 1 and engine.scheduler.max_rows == 1
    monkeypatch.setattr(engine.llama.api, "llama_init_from_model", real)
    assert greedy(engine) == expected
    assert counter.snapshot()[0].sum() > before  # the old context still counted, into the counter kept alive


def test_sequences_llama_cpp_cannot_make_a_context_for_decode_as_many_at_once_as_it_can(engine, monkeypatch):
    """serve and batch ask for a context of their batch size; where it does not fit, half as many, with a line, and
    the requests beyond wait: their replies are the ones each gets alone."""
    prompts = [[5, 17, 33, 2], [9, 4], [40, 41, 42], [7]]
    requests = [Request(p, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)) for p in prompts]
    alone = [engine.complete([r])[0].token_ids for r in requests]
    real, asked = engine.llama.api.llama_init_from_model, []

    def at_most_two(model, params):
        asked.append(params.n_seq_max)
        return real(model, params) if params.n_seq_max <= 2 else None

    monkeypatch.setattr(engine.llama.api, "llama_init_from_model", at_most_two)
    assert engine.make_room(8)
    assert asked == [8, 4, 2] and engine.llama.slots == 2 and engine.scheduler.max_rows == 2
    line = "llama.cpp could not make a context for 8 sequences of 256 positions; 2 decode together, the others wait"
    assert engine.warnings[-1] == line
    together = [c.token_ids for c in engine.complete(requests)]
    assert asked == [8, 4, 2] and engine.warnings.count(line) == 1  # not tried, nor said, again
    assert together == alone


# --- as a person sees it ------------------------------------------------------------------------------------------

def test_moedesk_batch_says_the_back_off_in_a_line_and_a_context_that_cannot_fit_in_one(qwen, faked, tmp_path,
                                                                                      capsys):
    from moedesk.app.cli import main
    from tests.app.test_batch import read_jsonl, write_jsonl

    path, shape = qwen
    failures, attempts = faked
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Experts live in", "temperature": 0,
                                               "max_new_tokens": 4}])
    # --batch-size: the faked GPU is not torch's, which the batch size from memory would ask
    flags = ["--engine", "llama.cpp", "--model", str(path), "--context", str(CONTEXT), "--batch-size", "1"]
    failures += [(cache_cells(CONTEXT) * shape.kv_per_position, "kv"), None]
    assert main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), *flags]) == 0
    assert attempts == [(0, True), (1, True)]
    assert "llama.cpp could not make its context on the GPU; experts of 1 of 4 layers in RAM" in capsys.readouterr().err
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 1

    failures[:], attempts[:] = [(GIB, "compute")] * 2, []
    assert main(["batch", str(src), "-o", str(tmp_path / "again.jsonl"), *flags]) != 0
    assert attempts == [(0, True), (4, True)]  # a GiB short: every layer's experts at once, then nothing to move
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("moedesk: ")
    assert "could not make a context of 256 positions on the GPU with every expert in RAM" in err.splitlines()[-1]


@pytest.mark.gpu
def test_on_the_gpu_a_kv_cache_that_does_not_fit_beside_the_weights_moves_experts_to_ram(tmp_path):
    """On the GPU box (llama-cpp-python built with CUDA), a real out-of-memory: torch holds all of the GPU but the
    weights' room and three quarters of the KV cache's, so llama.cpp loads the weights and then cannot allocate the
    cache. The load keeps enough layers' experts in RAM (100 MiB a layer, the cache 256 MiB) and decodes, once torch
    lets go, as a load asked for that placement does."""
    import dataclasses

    import torch

    import tests.gguf_from_hf as hf
    from moedesk.engine.llamacpp.buffers import llama_buffers, on_device
    from moedesk.engine.llamacpp.library import library

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    qwen3 = hf.FAMILIES["qwen3moe"]
    big = dataclasses.replace(qwen3, config={**qwen3.config, "hidden_size": 512, "moe_intermediate_size": 2048,
                                             "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
                                             "max_position_embeddings": 32768})
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(hf.FAMILIES, "qwen3moe-big", big)
        path = str(hf.build("qwen3moe-big", tmp_path / "big").gguf)
    context = 16384

    mark = library().log_mark()
    engine = Engine.load(path, engine="llama.cpp", context_length=context, cpu_moe=0)
    used = on_device(llama_buffers(library().log_since(mark)))
    engine.close()
    torch.cuda.synchronize()
    hog = torch.empty(torch.cuda.mem_get_info()[0] - used["model"] - used["KV"] * 3 // 4, dtype=torch.uint8,
                      device="cuda")
    try:
        engine = Engine.load(path, engine="llama.cpp", context_length=context, cpu_moe=0)
    finally:
        del hog
        torch.cuda.empty_cache()
    try:
        said = [w for w in engine.warnings if w.startswith("llama.cpp could not make its context on the GPU")]
        assert said and engine.llama.offload_kv, (engine.warnings, used)
        pinned = engine.placement.cpu_moe
        assert 0 < pinned < 4, engine.placement.why
        backed_off = greedy(engine)
    finally:
        engine.close()
    direct = Engine.load(path, engine="llama.cpp", context_length=context, cpu_moe=pinned)
    try:
        assert greedy(direct) == backed_off
    finally:
        direct.close()
