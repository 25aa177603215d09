"""A hybrid model's recurrent state (llama.cpp's RS buffer) and its KV cache, estimated from the GGUF's header
(engine.llamacpp.state, engine.llamacpp.fit), against the sizes llama.cpp itself logs when it loads tiny Qwen3.5-MoE,
Qwen3-Next and LFM2-MoE files on the CPU; and the plan that counts them. Beside them, latent attention's cache."""
from __future__ import annotations

import sys

import pytest

from moedesk.engine.llamacpp.buffers import llama_buffers
from moedesk.engine.llamacpp.fit import Machine, cache_cells, gguf_shape, plan, read_header
from moedesk.engine.llamacpp.placement import GIB
from moedesk.engine.llamacpp.state import recurrent_layers, state_bytes_per_sequence, state_floats

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIB = 2**20
CONTEXT = 256
SEQUENCES = 64  # the state is per sequence: a context for many makes llama.cpp's two-decimal figure precise


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """make_family_gguf.py's toy Qwen3.5-35B-A3B (Gated DeltaNet, every fourth layer attention), and tiny
    Qwen3-Next and LFM2-MoE (short convolutions between attention layers) converted from transformers."""
    from tests.gguf_from_hf import build
    from tests.perf import make_family_gguf

    folder = tmp_path_factory.mktemp("hybrid")
    qwen35 = folder / "qwen35moe.gguf"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["make_family_gguf.py", "qwen3.5-35b-a3b", str(qwen35), "8", "--tiny"])
        make_family_gguf.main()  # in this process: a child would spend most of its time importing transformers
    return {"qwen35moe": qwen35, "qwen3next": build("qwen3next", folder / "next").gguf,
            "lfm2moe": build("lfm2moe", folder / "lfm2").gguf}


def as_logged(size: int) -> int:
    """`size` as llama.cpp's log line states it (MiB with two decimals) and llama_buffers reads it back."""
    return round(float(f"{size / MIB:.2f}") * MIB)


def logged(mark) -> dict[str, int]:
    from moedesk.engine.llamacpp.library import library

    return {what: size for (where, what), size in llama_buffers(library().log_since(mark)).items()
            if where == "CPU" and what in ("KV", "RS")}


@pytest.mark.parametrize("family", ["qwen35moe", "qwen3next", "lfm2moe"])
def test_the_state_and_cache_are_what_llama_cpp_allocates(family, hybrids):
    """Loaded on the CPU at 256 positions, then with room for 64 sequences: llama.cpp's RS buffer is the estimate's
    state per sequence times the sequences, its KV buffer the cache of the attention layers alone; and the plan's
    RAM holds both beside the weights."""
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    shape = gguf_shape(read_header(hybrids[family]))
    assert shape.state_per_sequence > 0
    mark = library().log_mark()
    engine = Engine.load(str(hybrids[family]), engine="llama.cpp", device="cpu", context_length=CONTEXT)
    try:
        one = logged(mark)
        assert one["KV"] == as_logged(cache_cells(CONTEXT) * shape.kv_per_position), (one, shape)
        assert one["RS"] == as_logged(shape.state_per_sequence), (one, shape)
        weights = shape.sizes.total_bytes
        assert engine.fit.ram_bytes == weights + cache_cells(CONTEXT) * shape.kv_per_position + shape.state_per_sequence

        mark = library().log_mark()
        assert engine.make_room(SEQUENCES) and engine.llama.slots == SEQUENCES  # not backed off to fewer
        many = logged(mark)
        assert many["RS"] == as_logged(SEQUENCES * shape.state_per_sequence), (many, shape)
        assert many["KV"] == as_logged(SEQUENCES * cache_cells(CONTEXT) * shape.kv_per_position)
    finally:
        engine.close()


def test_latent_attention_caches_keys_alone_as_llama_cpp_does(tmp_path):
    """DeepSeek-V3's MLA in llama.cpp: one cached "head" of kv_lora_rank + rope dimensions a layer, no separate
    values (a view of the keys). The estimate equals llama.cpp's KV buffer, where counting values too said 1.8x."""
    from gguf import GGUFReader

    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine
    from tests.gguf_from_hf import build

    path = build("deepseek2", tmp_path / "ds").gguf
    shape = gguf_shape(read_header(path))
    rank_and_rope = sum(GGUFReader(path).fields[f"deepseek2.{key}"].contents()
                        for key in ("attention.kv_lora_rank", "rope.dimension_count"))
    assert shape.kv_per_position == 2 * shape.layers * rank_and_rope  # f16
    mark = library().log_mark()
    engine = Engine.load(str(path), engine="llama.cpp", device="cpu", context_length=CONTEXT)
    try:
        mark, first = library().log_mark(), logged(mark)
        assert engine.make_room(SEQUENCES) and engine.llama.slots == SEQUENCES  # not backed off to fewer
        many = logged(mark)
    finally:
        engine.close()
    assert first["KV"] == as_logged(cache_cells(CONTEXT) * shape.kv_per_position)
    assert many["KV"] == as_logged(SEQUENCES * cache_cells(CONTEXT) * shape.kv_per_position)


def qwen35_35b_a3b(key: str):
    """Qwen/Qwen3.5-35B-A3B's text config as llama.cpp's converter writes it: 40 layers, every fourth full attention
    (2 key/value heads of 256); Gated DeltaNet with 16 key heads and 32 value heads of 128, a kernel of 4."""
    return {"block_count": 40, "embedding_length": 2048, "attention.head_count": 16, "attention.head_count_kv": 2,
            "attention.key_length": 256, "attention.value_length": 256, "full_attention_interval": 4,
            "ssm.conv_kernel": 4, "ssm.state_size": 128, "ssm.group_count": 16, "ssm.inner_size": 32 * 128,
            "ssm.time_step_rank": 32}.get(key)


def test_the_full_size_models_state_follows_llama_cpp_s_hparams():
    """n_embd_r = (kernel - 1) x (inner + 2 x groups x state) and n_embd_s = state x inner, in f32, for the 30 Gated
    DeltaNet layers of 40 (llama-hparams.cpp, llama-memory-recurrent.cpp): 62.81 MiB a sequence as llama.cpp would
    log it. Not loaded here (the full model); the toy files above check the same formula against llama.cpp."""
    layers = recurrent_layers("qwen35moe", qwen35_35b_a3b, 40)
    assert len(layers) == 30 and 3 not in layers and 39 not in layers and 0 in layers
    assert state_floats(qwen35_35b_a3b) == (3 * (4096 + 2 * 16 * 128), 128 * 4096)
    assert round(state_bytes_per_sequence("qwen35moe", qwen35_35b_a3b, 40) / MIB, 2) == 62.81
    # a file that lists its recurrent layers is taken at its word; an architecture without any has no state
    def listed(key):
        return [True, False] * 20 if key == "attention.recurrent_layers" else qwen35_35b_a3b(key)

    assert recurrent_layers("qwen35moe", listed, 40) == list(range(0, 40, 2))
    assert state_bytes_per_sequence("qwen3moe", qwen35_35b_a3b, 40) == 0


def test_a_gpu_budget_sets_the_state_aside_before_experts(hybrids):
    """On a GPU (as planned: this machine has none) one sequence's state goes there with the layers; a named budget
    spends it before experts, and the default budget the state of the sequences it reserves cache for."""
    import dataclasses

    from moedesk.engine.llamacpp.compute import activation_bytes
    from moedesk.engine.llamacpp.placement import expert_budget
    from moedesk.engine.offload.orchestration import KV_ROWS_RESERVED

    shape = gguf_shape(read_header(hybrids["qwen35moe"]))
    state, cells = shape.state_per_sequence, cache_cells(CONTEXT)
    gpu = Machine(gpu=True, gpu_free=8 * GIB, available=64 * GIB)
    with_state = plan(shape, gpu, CONTEXT, 1.0)
    without = plan(dataclasses.replace(shape, state_per_sequence=0), gpu, CONTEXT, 1.0)
    assert with_state.gpu_bytes - without.gpu_bytes == state
    fixed = (shape.other_on_gpu, shape.kv_per_position, cells, activation_bytes(shape.graph, cells))
    assert expert_budget(1.0, 0, *fixed, state) == expert_budget(1.0, 0, *fixed) - state
    free = 8 * GIB
    assert expert_budget(None, free, *fixed, state) == expert_budget(None, free, *fixed) - KV_ROWS_RESERVED * state


@pytest.mark.gpu
def test_on_the_gpu_the_state_is_in_the_gpu_s_buffers_as_planned(hybrids):
    """On the GPU box (llama-cpp-python built with CUDA): toy Qwen3.5-MoE with the first 2 layers' experts in RAM;
    llama.cpp's RS buffer on the GPU is the plan's state, and its model, KV and RS buffers there stay within the
    plan's GPU bytes (its compute buffer within the plan's)."""
    from moedesk.engine.llamacpp.buffers import on_device
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.runtime import Engine

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    shape = gguf_shape(read_header(hybrids["qwen35moe"]))
    mark = library().log_mark()
    engine = Engine.load(str(hybrids["qwen35moe"]), engine="llama.cpp", context_length=CONTEXT, cpu_moe=2)
    try:
        used, fit = on_device(llama_buffers(library().log_since(mark))), engine.fit
    finally:
        engine.close()
    assert fit.placement.cpu_moe == 2 and used["RS"] == as_logged(shape.state_per_sequence), (used, fit)
    assert used["model"] + used["KV"] + used["RS"] <= 1.02 * fit.gpu_bytes, (used, fit)
    assert used["compute"] <= fit.compute_bytes, (used, fit)
