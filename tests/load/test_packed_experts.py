"""Packed experts end to end: GGUF files quantised by llama.cpp's own quantiser (Q4_K_M, Q5_K_M, Q6_K, Q4_0,
Q8_0) load with their experts packed as the file holds them, compute logits within a stated tolerance of the
same model run from the dequantised weights, and agree with llama.cpp's top-1 on the same file; 16-bit experts
quantised while loading (--expert-dtype int8 / int4) stay close to the 16-bit model.

llama-cpp-python is a test dependency (the demo model's package brings it); its quantiser writes what users
download (a Q4_K_M file mixes q4_k and q6_k experts)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.runtime import Engine
from moedesk.kernels import cpu_quant
from tests.load.test_gguf_checkpoint import llama_cpp_permute, spm_vocab

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

# llama.cpp's file types (llama.h's LLAMA_FTYPE_MOSTLY_*) and the expert formats they give these shapes.
FILE_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
EXPERT_FORMATS = {"q4_0": {"q4_0"}, "q8_0": {"q8_0"}, "q4_k_m": {"q4_k", "q4_k/q6_k"},
                  "q5_k_m": {"q5_k", "q5_k/q6_k"}, "q6_k": {"q6_k"}}
TEXT = "the quick brown fox jumps over the lazy dog hello world over the dog"


def write_f32_moe(path, arch: str, H=256, F=512, E=4, L=2, heads=4, kv=2):
    """A float32 MoE GGUF as llama.cpp's converter writes one: llama (Mixtral) or qwen3moe, rows whole k-quant
    blocks (256) so that every quantisation applies to the experts."""
    rng = np.random.default_rng(7)
    hd = H // heads
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(E); w.add_expert_used_count(2); w.add_vocab_size(len(pieces)); w.add_file_type(0)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(F); w.add_key_length(hd); w.add_value_length(hd)
    else:
        w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def rnd(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", rnd(len(pieces), H, scale=1.0))
    w.add_tensor("output.weight", rnd(len(pieces), H))
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    permute = (lambda a, n: llama_cpp_permute(a, n)) if arch == "llama" else (lambda a, n: a)
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", permute(rnd(heads * hd, H), heads))
        w.add_tensor(p + "attn_k.weight", permute(rnd(kv * hd, H), kv))
        w.add_tensor(p + "attn_v.weight", rnd(kv * hd, H)); w.add_tensor(p + "attn_output.weight", rnd(H, heads * hd))
        if arch == "qwen3moe":
            w.add_tensor(p + "attn_q_norm.weight", 1 + rnd(hd)); w.add_tensor(p + "attn_k_norm.weight", 1 + rnd(hd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rnd(E, H, scale=0.8))
        w.add_tensor(p + "ffn_gate_exps.weight", rnd(E, F, H)); w.add_tensor(p + "ffn_up_exps.weight", rnd(E, F, H))
        w.add_tensor(p + "ffn_down_exps.weight", rnd(E, H, F))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """quantised(arch, kind) -> path of a GGUF that llama.cpp quantised to `kind`, built once."""
    folder = tmp_path_factory.mktemp("packed")
    made = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in made:
            source = folder / f"{arch}-f32.gguf"
            if not source.exists():
                write_f32_moe(source, arch)
            out = folder / f"{arch}-{kind}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = FILE_TYPES[kind], 2
            assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
            made[arch, kind] = out
        return made[arch, kind]

    return get


def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of every position of ids in one forward pass."""
    cache = KVCache(engine.config, rows=1, length=len(ids), dtype=engine.dtype, device=engine.device)
    tokens = torch.tensor([ids], device=engine.device)
    positions = torch.arange(len(ids), device=engine.device).unsqueeze(0)
    return engine.model(tokens, positions, cache, engine.executor)[0].float().cpu()


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    reference = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    reference.eval(ids)
    return torch.tensor(np.array(reference.scores[:len(ids)]), dtype=torch.float32)


@pytest.mark.parametrize("arch,kind", [("llama", k) for k in FILE_TYPES] + [("qwen3moe", "q4_k_m")])
def test_packed_gguf_experts_match_dequantised_weights_and_llama_cpp(quantised, arch, kind):
    path = quantised(arch, kind)
    packed = Engine.load(str(path), device="cpu", dtype="float32")
    formats = {moe.experts.describe() for moe in packed.model.moe_blocks()}
    assert formats <= EXPERT_FORMATS[kind] and formats, formats
    assert all(moe.experts.gate_up.dtype == torch.uint8 for moe in packed.model.moe_blocks())
    dense = Engine.load(str(path), device="cpu", dtype="float32", expert_dtype="bf16")  # dequantised at load
    assert all(not moe.experts.packed for moe in dense.model.moe_blocks())

    ids = packed.tokenizer.encode(TEXT)
    ours, exact = teacher_forced_logits(packed, ids), teacher_forced_logits(dense, ids)
    # The native kernel rounds activations to 8 bits a block of 32 before its integer dot products (as llama.cpp
    # does); the dequantising reference path is exact to float32 rounding. In units of the logits' spread: a mean
    # error under 1% and none over 6% (measured 0.46-0.53% and 2.3-4.7% over these files).
    error = (ours - exact).abs() / exact.std()
    assert error.mean() <= 0.01 and error.max() <= 0.06, (error.mean(), error.max())
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9

    theirs = llama_cpp_logits(path, ids)
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"{arch} {kind}: top-1 agreement with llama.cpp {agreement:.3f} over {len(ids)} positions")
    # llama.cpp also quantises the non-expert weights' activations; top-1 still agrees on nearly every position.
    assert agreement >= 0.85, agreement


def counted_native_calls(monkeypatch, function: str, owner, fallback: str, refusal: str) -> list:
    """A list that grows by one at each call of cpu_quant.<function> from here on; owner.<fallback> (the route that
    would dequantise instead) fails the test with `refusal`."""
    calls = []
    native = getattr(cpu_quant, function)
    monkeypatch.setattr(cpu_quant, function, lambda *a, **kw: calls.append(1) or native(*a, **kw))

    def refused(*args, **kwargs):
        raise AssertionError(refusal)

    monkeypatch.setattr(owner, fallback, refused)
    return calls


@pytest.mark.skipif(not cpu_quant.available(), reason="the native packed kernel is not built for this CPU")
def test_cpu_load_computes_packed_experts_in_one_native_call_a_layer(quantised, monkeypatch):
    """A load on the CPU alone (LocalExecutor) hands each MoE layer's packed experts to the native kernel once a step,
    as the offloading executor does, never to the dequantising reference, which re-dequantises every expert it
    runs at every step."""
    from moedesk.kernels import experts as expert_kernels

    engine = Engine.load(str(quantised("qwen3moe", "q4_k_m")), device="cpu", dtype="float32")
    calls = counted_native_calls(monkeypatch, "experts_forward_routed", expert_kernels, "_reference_one",
                                 "a packed expert went to the dequantising reference")
    ids = engine.tokenizer.encode(TEXT)
    logits = teacher_forced_logits(engine, ids)
    assert torch.isfinite(logits).all()
    assert len(calls) == len(list(engine.model.moe_blocks()))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("expert_dtype,bound", [("int8", 0.01), ("int4", 0.1)])
def test_experts_quantised_at_load_stay_close_to_16_bit(tiny_checkpoint, arch, expert_dtype, bound):
    """A 16-bit checkpoint's experts quantised while loading: top-1 agreement and the mean logit error (in units
    of the logits' spread) against the same model unquantised. q8_0 keeps ~2 decimal digits per weight, q4_0
    about one; random tiny models, whose weights have no outliers for a block scale to favour, are a hard case
    (measured: int8 0.002-0.004 mean error, every top-1 kept; int4 0.035-0.045, 90-95% of top-1)."""
    folder = str(tiny_checkpoint(arch))
    full = Engine.load(folder, device="cpu", dtype="float32")
    small = Engine.load(folder, device="cpu", dtype="float32", expert_dtype=expert_dtype)
    target = {"int8": "q8_0", "int4": "q4_0"}[expert_dtype]
    # The tiny models' experts are 48 wide: down's rows are not whole 32-weight blocks and stay dense.
    width = full.config.moe_intermediate_size
    assert {moe.experts.describe() for moe in small.model.moe_blocks()} == {target if width % 32 == 0
                                                                            else f"{target}/dense"}
    ids = full.tokenizer.encode(TEXT)[:48]
    exact, ours = teacher_forced_logits(full, ids), teacher_forced_logits(small, ids)
    error = ((ours - exact).abs().mean() / exact.std()).item()
    agreement = (ours.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"{arch} {expert_dtype}: mean logit error {error:.4f} of their spread, top-1 agreement {agreement:.3f}")
    assert error <= bound and agreement >= (0.95 if expert_dtype == "int8" else 0.75)


def test_demo_int4_experts_keep_most_of_its_top_1():
    """The demo model (SmolLM2 upcycled) with q4_0 experts: top-1 agreement with its 16-bit self on a prompt."""
    full = Engine.load("demo", device="cpu", dtype="float32")
    small = Engine.load("demo", device="cpu", dtype="float32", expert_dtype="int4")
    ids = full.tokenizer.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of")
    exact, ours = teacher_forced_logits(full, ids), teacher_forced_logits(small, ids)
    agreement = (ours.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"demo int4: top-1 agreement {agreement:.3f}, max logit error {(ours - exact).abs().max().item():.3f}")
    assert agreement >= 0.7
