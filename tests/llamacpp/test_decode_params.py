"""The context the engine decodes in asks llama.cpp for the same work per token as llama-bench's
`-ngl 99 -ncmoe N -t T -fa 1` (tools/llama-bench: to_llama_cparams, to_llama_mparams), issue 40's comparison.

Where the two differ they differ in what a decode step does not touch (n_ctx, n_batch: the cells a step attends
over are padded to 256 on both sides; flash attention auto, which resolves to on wherever llama-bench's on runs).
"""
import pytest

from moedesk.engine.llamacpp import engine as llama_engine
from moedesk.engine.llamacpp.decoder import LlamaContext
from moedesk.engine.llamacpp.fit import FIRST_SLOTS
from moedesk.engine.llamacpp.overrides import experts_pattern, matches
from moedesk.engine.llamacpp.placement import Placement

GGML_TYPE_F16 = 1


class _Recording:
    """The real ctypes API, with the params of every context made through it kept."""

    def __init__(self, api):
        self._api, self.made = api, []

    def __getattr__(self, name):
        return getattr(self._api, name)

    def llama_init_from_model(self, model, params):
        self.made.append({name: getattr(params, name) for name, _ in params._fields_})
        return self._api.llama_init_from_model(model, params)


@pytest.mark.parametrize("counting", [False, True])
def test_decode_context_asks_what_llama_bench_asks(demo_llama, counting):
    from moedesk.engine.llamacpp.expert_counts import ExpertCounter
    from moedesk.engine.llamacpp.library import library

    api = _Recording(library().api)
    counter = ExpertCounter(library().api, library().ggml, 2, 4) if counting else None
    context = LlamaContext(api, demo_llama.llama.model, 256, FIRST_SLOTS, 512, 3, offload_kv=True, counter=counter)
    try:
        params = api.made[-1]
    finally:
        context.close()
    defaults = library().api.llama_context_default_params()
    assert params["n_seq_max"] == 1  # one sequence: llama-bench's default, one stream of cells
    assert params["n_threads"] == params["n_threads_batch"] == 3  # llama_set_n_threads(ctx, t, t)
    assert params["n_ubatch"] == 512  # llama-bench's -ub default
    # on where llama-bench's -fa 1 runs; never off
    assert params["flash_attn_type"] in (defaults.flash_attn_type, 1) and params["flash_attn_type"] != 0
    assert params["type_k"] == params["type_v"] == GGML_TYPE_F16
    assert params["offload_kqv"] and params["op_offload"] and not params["embeddings"]
    assert params["kv_unified"] == defaults.kv_unified  # with one sequence one stream either way
    # No eval callback unless the experts are counted: with one, llama.cpp asks it about every node of every step.
    assert bool(params["cb_eval"]) == counting
    # The context holds the request and then some: a step attends over at most 256 cells more than it uses.
    assert params["n_ctx"] >= 256


def test_model_params_match_llama_bench_ncmoe(monkeypatch):
    """-ngl 99 puts every layer and the output on the GPU (n_layers + 1 here); the first N layers' experts go to the
    CPU's buffer by the same tensors llama-bench's regex picks; repacking and pinned host memory as llama.cpp's
    defaults, as llama-bench leaves them."""
    from moedesk.engine.llamacpp.library import library
    from tests.llamacpp.test_gpu_split import fake_lib

    lib, seen = library(), {}

    def record(params):
        seen.update(gpu_layers=params.n_gpu_layers, extra=params.use_extra_bufts, no_host=params.no_host,
                    devices=params.devices, overrides=bool(params.tensor_buft_overrides))

    placement = Placement(gpu_layers=9, cpu_moe=8, layers=8, expert_bytes_in_ram=1, why="")
    handle, stopped = llama_engine._load_file(fake_lib(record), "x.gguf", placement, None)
    assert handle is None and not stopped
    defaults = lib.api.llama_model_default_params()
    # the extra buffers on, as llama.cpp's own default, unless its AMX kernels crash here (engine.llamacpp.amx_probe)
    assert seen == {"gpu_layers": 9, "extra": True, "no_host": defaults.no_host, "devices": None, "overrides": True}
    llama_engine._load_file(fake_lib(record), "x.gguf", placement, None, extra_buffers=False)
    assert seen["extra"] is False
    # llama-bench's pattern for layer i: blk\.i\.ffn_(up|down|gate|gate_up)_(ch|)exps (common.h)
    pattern = experts_pattern(placement.cpu_expert_layers())
    for layer in range(8):
        for part in ("up", "down", "gate", "gate_up"):
            assert matches(pattern, f"blk.{layer}.ffn_{part}_exps.weight")
        assert not matches(pattern, f"blk.{layer}.ffn_gate_inp.weight")
        assert not matches(pattern, f"blk.{layer}.attn_q.weight")


def test_llama_cpp_takes_the_thread_count_between_steps(demo_llama):
    context = demo_llama.llama
    assert demo_llama.scheduler.cpu_share.set_threads == context.set_threads
    before = context.threads
    try:
        context.set_threads(2)
        assert demo_llama.api.llama_n_threads(context.ctx) == 2
        assert demo_llama.api.llama_n_threads_batch(context.ctx) == 2
    finally:
        context.set_threads(before)
    assert demo_llama.api.llama_n_threads(context.ctx) == before
