"""The llama.cpp engine's decisions, without loading a model: which engine, which layers' experts in RAM, the
override pattern and what llama.cpp's log says it did with it, the CUDA rebuild line."""
from __future__ import annotations

import pytest

from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.llamacpp.library import CUDA_REBUILD, cuda_hint
from moedesk.engine.llamacpp.overrides import experts_pattern, matches, overridden_tensors
from moedesk.engine.llamacpp.placement import GIB, cpu_moe_layers, expert_budget, gguf_sizes, place
from moedesk.engine.selection import after_refusal, choose_engine

MIB = 2**20
# A Mixtral-like file: 4 layers of 100 MiB experts (gate, up, down), 60 MiB of the rest, a shared expert.
TENSORS = [("token_embd.weight", 40 * MIB), ("output.weight", 20 * MIB)]
for layer in range(4):
    TENSORS += [(f"blk.{layer}.ffn_{p}_exps.weight", 100 * MIB // 3) for p in ("gate", "up", "down")]
    TENSORS += [(f"blk.{layer}.ffn_up_shexp.weight", 0), (f"blk.{layer}.attn_q.weight", 0)]


def test_sizes_split_routed_experts_per_layer_from_the_rest():
    sizes = gguf_sizes(TENSORS + [("blk.3.ffn_gate_up_exps.bias", 6)])
    assert sizes.expert_bytes == (3 * (100 * MIB // 3),) * 3 + (3 * (100 * MIB // 3) + 6,)
    assert sizes.other_bytes == 60 * MIB  # the shared expert is not routed: it stays with the rest


@pytest.mark.parametrize("budget_mib,expected", [(0, 4), (99, 4), (100, 3), (250, 2), (400, 0), (10_000, 0)])
def test_the_fewest_layers_in_ram_whose_remaining_experts_fit_the_budget(budget_mib, expected):
    assert cpu_moe_layers((100 * MIB,) * 4, budget_mib * MIB) == expected


def test_a_named_budget_is_the_whole_gpus_and_the_cache_of_the_context_comes_before_experts():
    """As for the native engine: other weights, one sequence's cache at the context, then experts; but no
    allocator slack, since llama.cpp allocates its buffers whole (the native engine keeps 5% of the budget)."""
    from moedesk.engine.offload.gpu_budget import ContextBudgetError, split_gpu_budget

    per = 128 * 1024  # Mixtral's f16 keys and values per position
    experts = expert_budget(16, 0, 3 * GIB, per, 32768)
    assert experts == 16 * GIB - 3 * GIB - 4 * GIB
    assert experts - split_gpu_budget(16 * GIB, 3 * GIB, per, 32768, 0).experts == int(0.05 * 16 * GIB)
    assert expert_budget(16, 0, 3 * GIB, per, 8192) - experts == 3 * GIB  # a shorter context: more experts
    assert expert_budget(0, 0, 3 * GIB, per, 32768) == 0  # 0: every expert in RAM
    with pytest.raises(ContextBudgetError, match=r"at most \d+ or raise --gpu-budget"):
        expert_budget(6, 0, 3 * GIB, per, 32768)


def test_placement_without_a_gpu_keeps_everything_in_ram_and_overrides_nothing():
    sizes = gguf_sizes(TENSORS)
    p = place(sizes, 4, gpu=False, budget_bytes=10 * GIB)
    assert p.gpu_layers == 0 and p.cpu_expert_layers() == [] and p.expert_bytes_in_ram == sum(sizes.expert_bytes)
    assert not any(p.expert_layer_on_gpu(i) for i in range(4))
    assert place(sizes, 4, gpu=False, budget_bytes=0, cpu_moe=2).cpu_expert_layers() == [0, 1]  # asked: pinned


def test_placement_with_a_gpu_offloads_every_layer_and_pins_the_first_layers_experts():
    sizes = gguf_sizes(TENSORS)
    p = place(sizes, 4, gpu=True, budget_bytes=int(2.5 * sizes.expert_bytes[0]))
    assert p.gpu_layers == 5 and p.cpu_expert_layers() == [0, 1]
    assert [p.expert_layer_on_gpu(i) for i in range(4)] == [False, False, True, True]
    assert "2 of 4 layers" in p.why
    assert place(sizes, 4, gpu=True, budget_bytes=0, cpu_moe=3).cpu_expert_layers() == [0, 1, 2]


def test_the_override_pattern_takes_exactly_the_named_layers_routed_experts():
    pattern = experts_pattern([0, 2])
    names = [name for name, _ in TENSORS] + ["blk.12.ffn_up_exps.weight", "blk.0.ffn_gate_up_exps.bias"]
    taken = {name for name in names if matches(pattern, name)}
    assert taken == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 2) for p in ("gate", "up", "down")} | {
        "blk.0.ffn_gate_up_exps.bias"}
    assert experts_pattern([]) is None


def test_overridden_tensors_are_read_from_llama_cpps_load_log():
    log = ["llama_model_loader: tensor overrides to CPU are used with mmap enabled",
           "tensor blk.0.ffn_gate_exps.weight (0 MiB q4_0) buffer type overridden to CPU_REPACK",
           "tensor blk.0.ffn_down_exps.weight (12 MiB q4_k) buffer type overridden to CPU",
           "load_tensors:   CPU_REPACK model buffer size =     2.85 MiB"]
    assert overridden_tensors(log) == {"blk.0.ffn_gate_exps.weight": "CPU_REPACK", "blk.0.ffn_down_exps.weight": "CPU"}



def test_a_gpu_host_buffer_chosen_for_a_mapped_file_is_read_as_the_cpus():
    """A CUDA build logs its pinned host memory as the choice for experts pinned to RAM; from a memory-mapped file
    llama.cpp keeps them in the CPU's buffer instead (what the GPU box's read-back finds), from a read one there."""
    choice = ["tensor blk.0.ffn_up_exps.weight (2 MiB f32) buffer type overridden to CUDA_Host"]
    mapped = "load_tensors: loading model tensors, this can take a while... (load_mode = mmap)"
    read = "load_tensors: loading model tensors, this can take a while... (load_mode = none)"
    assert overridden_tensors([mapped, *choice]) == {"blk.0.ffn_up_exps.weight": "CPU"}
    assert overridden_tensors([read, *choice]) == {"blk.0.ffn_up_exps.weight": "CUDA_Host"}

def test_the_cuda_rebuild_line_only_where_an_nvidia_gpu_meets_a_cpu_build():
    line = cuda_hint(1, gpu_offload=False)
    assert CUDA_REBUILD in line and "\n" not in line
    assert cuda_hint(0, gpu_offload=False) is None and cuda_hint(2, gpu_offload=True) is None


def test_engine_choice(tmp_path):
    assert choose_engine("demo", "auto") is None  # native first
    assert choose_engine("anything", "native").kind == "native"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    chosen = choose_engine(str(gguf), "llama.cpp", lambda: None)
    assert chosen.kind == "llama.cpp" and chosen.model == str(gguf)
    with pytest.raises(MoedeskError, match="not installed"):
        choose_engine(str(gguf), "llama.cpp", lambda: "llama.cpp engine unavailable: not installed")
    assert choose_engine(str(tmp_path), "llama.cpp", lambda: None).model == str(gguf)  # a folder of one GGUF
    (tmp_path / "safetensors").mkdir()
    with pytest.raises(MoedeskError, match="reads GGUF files only, so with the engine set to llama.cpp it would not load"):
        choose_engine(str(tmp_path / "safetensors"), "llama.cpp", lambda: None)
    with pytest.raises(MoedeskError, match="choose one of"):
        choose_engine("demo", "vllm")


def test_what_stops_a_checkpoint_that_is_no_gguf_for_each_engine_setting():
    from moedesk.engine.selection import not_gguf

    refused = "unsupported architecture 'lfm2_moe'"
    assert not_gguf("auto") is None and not_gguf("native") is None  # the native engine loads it
    assert not_gguf("native", refused) == refused
    assert not_gguf("auto", refused).startswith(refused) and "reads GGUF files only" in not_gguf("auto", refused)
    for read, problem in ((True, None), (True, refused), (False, None)):
        line = not_gguf("llama.cpp", problem, read)
        assert line.startswith("the llama.cpp engine reads GGUF files only") and line.endswith("GGUF of this model")
        assert ("auto or native" in line) == (problem is None)  # offered only where the native engine may run it
        assert ("if the native engine implements" in line) == (not read) and (refused in line) == bool(problem)


def test_auto_after_a_refusal_takes_llama_cpp_for_a_gguf_and_says_what_to_do_otherwise(tmp_path):
    refusal = UnsupportedModelError(tmp_path / "m.gguf", "unsupported GGUF architecture 'minimax-m2'")
    chosen = after_refusal(refusal, lambda: None)
    assert chosen.kind == "llama.cpp" and "minimax-m2" in chosen.why and chosen.model.endswith("m.gguf")
    with pytest.raises(UnsupportedModelError, match="minimax-m2.*not installed"):
        after_refusal(refusal, lambda: "llama.cpp engine unavailable: not installed")
    with pytest.raises(UnsupportedModelError, match="use a GGUF of this model"):
        after_refusal(UnsupportedModelError(tmp_path, "unsupported model_type 'minimax_m2'"), lambda: None)


def test_the_models_screen_names_llama_cpp_for_a_gguf_of_an_architecture_native_lacks():
    from moedesk.engine.selection import Choice, listed_engine, not_gguf

    assert listed_engine("lfm2moe", gguf=True).kind == "llama.cpp" and "lfm2moe" in listed_engine("lfm2moe", True).why
    assert listed_engine("gpt-oss", gguf=True).kind == "native"
    assert listed_engine("qwen3moe", gguf=True).kind == "native"
    assert listed_engine("qwen3moe", gguf=True, requested="llama.cpp").kind == "llama.cpp"
    # A safetensors checkpoint: what its load would do with the setting, in the line the load stops with.
    assert listed_engine("mixtral", gguf=False, requested="llama.cpp") == Choice("none", "", not_gguf("llama.cpp"))
    assert listed_engine("mixtral", gguf=False, requested="llama.cpp", read=False).why == \
        not_gguf("llama.cpp", read=False)
    refused = "unsupported architecture 'lfm2_moe'"
    for requested in ("auto", "native", "llama.cpp"):
        assert listed_engine("lfm2_moe", False, requested, refused) == Choice("none", "", not_gguf(requested, refused))
    assert listed_engine("mixtral", gguf=False).kind == "native" == listed_engine("mixtral", False, "native").kind
