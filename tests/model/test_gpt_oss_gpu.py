"""gpt-oss on CUDA with every expert on the GPU: its biased, clamped experts run in the GPU kernels (MXFP4 packed in
kernels.gpu_quant, bf16 in kernels.gpu_experts / gpu_grouped), never the dequantising reference, and the greedy
tokens are transformers' (in bfloat16 up to the reference's own ties: tests/model/test_gpu_equivalence.py)."""
import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.kernels import experts, gpu_experts, gpu_quant
from tests.model.test_families import assert_int8_logits_close, mxfp4_checkpoint
from tests.model.test_gpu_equivalence import PROMPTS, check_greedy, within_int8_rounding
from tests.reference import hf_greedy

pytestmark = pytest.mark.gpu


def spy(monkeypatch, module, name, calls):
    real = getattr(module, name)
    tag = f"{module.__name__.rpartition('.')[2]}.{name}"
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(tag) or real(*a, **k))


def mxfp4_rounds_activations() -> bool:
    """Whether a decode step's MXFP4 experts on the GPU round x to int8 (kernels.gpu_quant's integer route), as
    llama.cpp's do: the greedy tokens may then part from transformers' wherever int8 rounding ties them."""
    return gpu_quant._Q8_MXFP4 and gpu_quant._Q8_WANTED


def check_int8_logits(engine, exact, prompts_ids, new_tokens=16):
    """Where x is rounded to int8 before the experts, a near-tie in a router or the logits flips a greedy run on this
    tiny random model (its experts' outputs dwarf the residual stream), so the logits are checked teacher-forced along
    float32 transformers' greedy tokens, with the bounds test_families holds the CPU's int8 kernel to."""
    from tests.model.test_gpu_equivalence import teacher_forced_logits

    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    device = next(exact.parameters()).device
    pairs = []
    for prompt in prompts_ids:
        ids = prompt + hf_greedy(exact, prompt, new_tokens, eos)
        with torch.no_grad():
            pairs.append((teacher_forced_logits(engine, ids),
                          exact(torch.tensor([ids], device=device)).logits[0].float().cpu()))
    assert_int8_logits_close(pairs, "gpt-oss MXFP4 on the GPU's integer route")


def load_on_gpu(folder, dtype, monkeypatch, tmp_path):
    """The engine with every expert resident, and the kernel calls it makes from then on; the reference path fails
    if taken (after the load: the start-up profile times the CPU's path, which may be the reference)."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    engine = Engine.load(str(folder), device="cuda", dtype=dtype)
    calls = []
    spy(monkeypatch, gpu_quant, "grouped_experts_forward", calls)
    spy(monkeypatch, gpu_experts, "grouped_experts_forward", calls)

    def no_reference(*args, **kwargs):
        raise AssertionError("an expert took the dequantising reference path")

    monkeypatch.setattr(experts, "_reference_one", no_reference)
    stats = engine.expert_stats()
    assert stats["experts_on_gpu"] == stats["experts_total"], stats
    assert all(engine.executor.runs_on_device(layer) for layer in engine.executor.banks), \
        "every layer should run on the device in one grouped launch (whole_layers_on_device)"
    return engine, calls


def reference_mxfp4(folder, dtype, device="cuda"):
    """transformers' model of the MXFP4 checkpoint, dequantised, in `dtype`. Its dequantiser writes bf16 whatever
    dtype is asked for; MXFP4 values are exact in bf16 and in float32, so the cast loses nothing."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, quantization_config=transformers.Mxfp4Config(dequantize=True)).to(device).eval()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def test_gpt_oss_mxfp4_bf16_greedy_with_experts_packed_on_the_gpu(tiny_checkpoint, tmp_path, monkeypatch):
    folder = mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    engine, calls = load_on_gpu(folder, "bfloat16", monkeypatch, tmp_path)
    bank = next(iter(engine.executor.banks.values())).gpu
    assert bank.describe() == "mxfp4" and bank.gate_up.is_cuda and not bank.plain
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    if mxfp4_rounds_activations():
        check_int8_logits(engine, reference_mxfp4(folder, torch.float32), prompts)
    else:
        check_greedy(engine, reference_mxfp4(folder, torch.bfloat16), prompts)
    assert calls and set(calls) == {"gpu_quant.grouped_experts_forward"}, set(calls)


def test_gpt_oss_mxfp4_float32_greedy_equals_transformers(tiny_checkpoint, tmp_path, monkeypatch):
    # float32: the packed kernel's FMAs differ from the reference only in summation order: the same tokens exactly.
    folder = mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    engine, calls = load_on_gpu(folder, "float32", monkeypatch, tmp_path)
    ref = reference_mxfp4(folder, torch.float32)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    params = SamplingParams(max_new_tokens=20, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)], 2)}
    assert [done[i] for i in range(len(prompts))] == [hf_greedy(ref, p, 20, eos) for p in prompts]
    assert calls and set(calls) == {"gpu_quant.grouped_experts_forward"}, set(calls)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpt_oss_dense_experts_on_the_gpu_without_the_reference(dtype, tiny_checkpoint, tmp_path, monkeypatch):
    # bf16/float32 experts with biases and the clamped SwiGLU: torch's grouped GEMM (bf16 on sm90) or the Triton
    # launch, rounding as transformers' torch ops do.
    from tests.reference import hf_model

    folder = tiny_checkpoint("gpt_oss")
    engine, calls = load_on_gpu(folder, dtype, monkeypatch, tmp_path)
    assert not next(iter(engine.executor.banks.values())).gpu.plain
    check_greedy(engine, hf_model(folder, getattr(torch, dtype), "cuda"), [engine.tokenizer.encode(p) for p in PROMPTS])
    assert calls and set(calls) == {"gpu_experts.grouped_experts_forward"}, set(calls)


@pytest.mark.parametrize("share", ["streamed", "rows"])
@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "bf16"])
def test_gpt_oss_zero_copy_from_ram_matches_all_on_gpu(packed, share, tiny_checkpoint, tmp_path, monkeypatch):
    """Decode at batch 1 with every expert in pinned RAM and the GPU reading them there (kernels.gpu_zero_copy):
    each token's every expert, or each expert's last 32 rows beside the CPU's first ones (the GPU's part adding the
    down bias). The all-on-GPU run's tokens, up to bf16 ties; the biases travel pinned with the stacks."""
    from tests.model.test_gpu_equivalence import check_matches_all_on_gpu
    from tests.pinned_profile import pin_profile

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    pin_profile(monkeypatch)
    folder = mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4") if packed else tiny_checkpoint("gpt_oss")
    resident = Engine.load(str(folder), device="cuda", dtype="bfloat16", offload=False)
    offloaded = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    host = next(iter(offloaded.executor.banks.values())).host
    assert host.is_pinned() and host.gate_up_bias.is_pinned() and host.down_bias.is_pinned()
    executor = offloaded.executor
    if share == "streamed":
        executor.zero_copy_ranks = lambda k: k
    else:
        executor.zero_copy_ranks = lambda k: 0
        executor.split_width = lambda k: host.width - 32
    # The CPU's rows of packed experts take the int8 kernel (kernels.cpu_quant); the all-GPU run rounds x to int8
    # where mxfp4 takes the integer route, the streamed experts never do.
    # Where the two bf16 runs part: neither further from the float32 model than the other (the zero-copy kernel
    # sums an expert's products in another order than the grouped GEMM, and a run of tokens amplifies a difference).
    exact = Engine.load(str(folder), device="cuda", dtype="float32", offload=False)
    check_matches_all_on_gpu(offloaded, resident, batch_size=1,
                             tied=within_int8_rounding if packed and (share == "rows" or mxfp4_rounds_activations())
                             else None, exact=exact)
    stats = executor.stats
    assert (stats.zero_copy_experts if share == "streamed" else stats.split_experts) > 0, stats
