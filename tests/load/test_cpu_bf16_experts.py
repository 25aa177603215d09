"""A float32 load on the CPU keeps the experts a checkpoint stores in bfloat16 in bfloat16
(engine.load.loader.expert_stack_dtype): half the RAM and half the bytes a token reads, computed by
kernels/cpu_experts.c, and the memory estimate says so before any weight is read."""
from __future__ import annotations

import pytest
import torch

from moedesk.engine.load.size_estimate import summarize_path
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.kernels import cpu_experts
from tests import tiny_models
from tests.model.test_equivalence import PROMPTS
from tests.model.test_gpu_equivalence import check_greedy, teacher_forced_logits
from tests.reference import hf_greedy, hf_model

needs_kernel = pytest.mark.skipif(not cpu_experts.cpu_runs_it(), reason="the CPU experts kernel does not run here")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """bf16_checkpoint(arch) -> a tiny checkpoint of `arch` whose files store bfloat16, built once per module."""
    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = tiny_models.build(arch, tmp_path_factory.mktemp(arch), stored=torch.bfloat16)
        return built[arch]

    return get


@needs_kernel
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_experts_stay_bf16_and_the_estimate_says_so(arch, bf16_checkpoint):
    folder = bf16_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in engine.model.moe_blocks()]
    # gpt-oss's experts (biases, a clamped activation) are not what the kernel computes: they stay float32.
    expected = torch.float32 if arch == "gpt_oss" else torch.bfloat16
    assert {w.dense_dtype for w in stacks} == {expected}
    assert {p.dtype for n, p in engine.model.named_parameters() if "norm" not in n} == {torch.float32}
    weights = summarize_path(folder)
    on_cpu, beside_gpu = weights.estimate("auto", "float32"), weights.estimate("auto", "float32", gpu=True)
    assert on_cpu.expert_bytes == sum(w.nbytes for w in stacks)
    assert beside_gpu.expert_bytes == on_cpu.expert_bytes * (4 // expected.itemsize)  # pinned banks take the dtype
    assert on_cpu.experts_as == ("f32" if arch == "gpt_oss" else "bf16")
    # `moedesk profile`, `batch` and `serve` name what the experts are held in where the weights' dtype does not
    assert engine.description.endswith("on cpu float32" + ("" if arch == "gpt_oss" else ", experts bfloat16"))


def test_float32_files_keep_float32_experts(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    assert {moe.experts.dense_dtype for moe in engine.model.moe_blocks()} == {torch.float32}


@needs_kernel
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_as_exact_as_transformers_bf16(arch, bf16_checkpoint):
    """The experts' arithmetic is bf16's (the tokens rounded to it); the rest stays float32, so the logits are no
    further from float32 transformers on the same weights than bf16 transformers is."""
    folder = bf16_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    check_greedy(engine, hf_model(folder, torch.bfloat16), [engine.tokenizer.encode(p) for p in PROMPTS],
                 ref32=hf_model(folder))


def test_expert_dtype_bf16_keeps_the_float32_arithmetic(bf16_checkpoint):
    """`--expert-dtype bf16` holds the experts in the weights dtype: float32's arithmetic, transformers' tokens."""
    folder = bf16_checkpoint("qwen3_moe")
    engine = Engine.load(str(folder), device="cpu", dtype="float32", expert_dtype="bf16")
    assert {moe.experts.dense_dtype for moe in engine.model.moe_blocks()} == {torch.float32}
    ref, eos = hf_model(folder), engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        done = engine.generate([Request(ids, SamplingParams(max_new_tokens=12, temperature=0))])
        assert next(iter(done)).token_ids == hf_greedy(ref, ids, 12, eos)


@needs_kernel
def test_fused_experts_as_released_stay_bf16_too(tmp_path):
    """Qwen3.5-MoE's experts fused in two tensors a layer (engine.load.fused_experts) are read one expert at a
    time: each keeps its fused tensor's dtype, in the load and in the estimate."""
    from tests.gguf_from_hf import build
    from tests.load.test_packed_memory import write_fused_qwen35

    write_fused_qwen35(tmp_path / "model", build("qwen35moe", tmp_path / "template").folder, H=64, F=32, E=4)
    engine = Engine.load(str(tmp_path / "model"), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in engine.model.moe_blocks()]
    assert {w.dense_dtype for w in stacks} == {torch.bfloat16}
    assert summarize_path(tmp_path / "model").estimate("auto", "float32").expert_bytes == sum(w.nbytes for w in stacks)
    done = engine.generate([Request(engine.tokenizer.encode(PROMPTS[1]), SamplingParams(max_new_tokens=4))])
    assert len(next(iter(done)).token_ids) == 4


@needs_kernel
def test_a_gguf_s_bf16_experts_stay_bf16_too(tmp_path):
    """A GGUF's BF16 experts as a safetensors checkpoint's: kept so on a float32 CPU load, their logits within bf16
    rounding of the same weights computed in float32 (`--expert-dtype bf16`)."""
    from tests.load.test_gguf_checkpoint import Q, write_tiny_mixtral

    write_tiny_mixtral(tmp_path / "bf16.gguf", experts_as=Q.BF16)
    ours = Engine.load(str(tmp_path / "bf16.gguf"), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in ours.model.moe_blocks()]
    assert {w.dense_dtype for w in stacks} == {torch.bfloat16}
    assert summarize_path(tmp_path / "bf16.gguf").estimate("auto", "float32").expert_bytes == \
        sum(w.nbytes for w in stacks)
    exact = Engine.load(str(tmp_path / "bf16.gguf"), device="cpu", dtype="float32", expert_dtype="bf16")
    assert {moe.experts.dense_dtype for moe in exact.model.moe_blocks()} == {torch.float32}
    ids = ours.tokenizer.encode(PROMPTS[2])
    a, b = (teacher_forced_logits(engine, ids) for engine in (ours, exact))
    assert 0 < ((a - b).norm() / b.norm()).item() < 1e-2  # rounded (the kernel ran), and by little
