"""llama.cpp runs 2026's MoE families as transformers does: tiny random checkpoints of gpt-oss (float and, as
released, MXFP4 experts), Qwen3.5-MoE, Qwen3-Next, GLM-4.x-MoE, GLM-4.7-Flash (a deepseek2 file, as llama.cpp's
converter writes it), DeepSeek-V3, MiniMax-M2 and LFM2-MoE, written as
GGUF by tests/gguf_from_hf.py, through llama-cpp-python's bundled llama.cpp on the CPU, and through moedesk's
Engine.

Per family, on three prompts of 16 greedy tokens. Plain attention: llama.cpp tokenizes as the checkpoint's
tokenizer does, its greedy ids equal transformers' exactly (every family), and its logits along transformers'
greedy path stay within LOGIT_TOLERANCE (float32 weights on both sides: what is left is summation order; MXFP4
has its own bound). The logit bound catches a conversion that is almost right: an M-RoPE section layout that
rotated one pair of Qwen3.5's rotary dims by position 0 kept the greedy ids of two prompts of three, with
logits 2e-2 apart. Flash attention (what moedesk's llama.cpp engine runs, as llama-server does) rounds
differently: exact for gpt-oss, qwen35moe, qwen3next, deepseek2 and lfm2moe; 47 of 48 top-1 for glm4moe (one
token whose group-limited routing is a near-tie, group scores 2e-5 apart, choosing the other group) and for
minimax-m2 (one token whose two best logits are 1.4e-4 apart); 47 of 48 for GLM-4.7-Flash (not traced).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_from_hf import FAMILIES, build
from tests.tiny_models import SPECIAL
from tests.reference import hf_greedy, llama_greedy

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):\n    return",
    "Experts live in RAM; the most popular ones",  # with 16 new tokens, past gpt-oss's sliding window of 8
]
NEW_TOKENS = 16
EOS = SPECIAL.index("<|im_end|>")
LOGIT_TOLERANCE = 5e-3  # observed: at most 1.5e-3 on logits of standard deviation ~0.7
# MXFP4 experts: llama.cpp rounds the activations to 8 bits for their dot products (observed 3.1e-2; with the
# nibbles of a block in the Hub's order instead of GGUF's, 2.2 and no greedy token right).
LOGIT_TOLERANCES = {"gpt-oss-mxfp4": 0.1}
# Teacher-forced top-1 agreement with transformers under flash attention, per family (the floor: 95%).
FLASH_AGREEMENT = {"gpt-oss": 1.0, "qwen35moe": 1.0, "deepseek2": 1.0, "glm4-moe-lite": 0.95, "glm4moe": 0.95,
                   "minimax-m2": 0.95, "qwen3next": 1.0, "lfm2moe": 1.0, "gpt-oss-mxfp4": 1.0}
# The writer's Qwen3-MoE is for tests of a thinking template on llama.cpp (test_reasoning.py); the native engine runs
# it, and tests/load checks native GGUF reading.
NEW_FAMILIES = sorted(set(FAMILIES) - {"qwen3moe"})


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    name = request.param
    built = build(name, tmp_path_factory.mktemp(name))
    # One thread: on two shared cores a second thread's barrier waits cost 30x the work of a model this small.
    llm, flash = (llama_cpp.Llama(str(built.gguf), n_ctx=128, n_threads=1, n_threads_batch=1, logits_all=True,
                                  flash_attn=fa, verbose=False) for fa in (False, True))
    yield name, built, llm, flash
    llm.close()
    flash.close()


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy_paths(built) -> list[list[int]]:
    """Each prompt followed by transformers' greedy tokens: the paths the native engine is teacher-forced along."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    return [(ids := tokenizer.encode(p).ids) + hf_greedy(built.model, ids, NEW_TOKENS)[:-1] for p in PROMPTS]


def native_engines(built):
    """The native engine on the GGUF twice: experts resident, and every expert computed in RAM."""
    from moedesk.engine.runtime import Engine

    resident = Engine.load(str(built.gguf), device="cpu", dtype="float32")
    in_ram = Engine.load(str(built.gguf), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    in_ram.executor.decide = lambda loads: (sorted(loads), [])  # every expert computed where it lives, in RAM
    return resident, in_ram


@pytest.mark.parametrize("family", NEW_FAMILIES, indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_llamacpp_greedy_equals_transformers(family):
    from tokenizers import Tokenizer

    name, built, llm, _ = family
    assert llm.metadata["general.architecture"] == FAMILIES[name].gguf_arch
    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    model = built.model
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids, prompt

        expected = hf_greedy(model, ids, NEW_TOKENS)
        assert len(expected) == NEW_TOKENS  # the tiny tokenizer's end token never wins here
        assert llama_greedy(llm, ids, NEW_TOKENS) == expected, f"{name}: {prompt!r}"

        path = ids + expected[:-1]
        with torch.no_grad():
            reference = model(torch.tensor([path])).logits[0].numpy()
        gap = np.abs(llama_logits(llm, path) - reference).max()
        assert gap < LOGIT_TOLERANCES.get(name, LOGIT_TOLERANCE), f"{name}: {prompt!r}: logits {gap:.2e} apart"



@pytest.mark.parametrize("family", NEW_FAMILIES, indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_llamacpp_flash_attention_top1_agreement(family):
    from tokenizers import Tokenizer

    name, built, _, flash = family
    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    agree = total = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        expected = hf_greedy(built.model, ids, NEW_TOKENS)
        predicted = llama_logits(flash, ids + expected[:-1])[len(ids) - 1:].argmax(-1)
        agree += int((predicted == np.array(expected)).sum())
        total += len(expected)
    assert agree / total >= FLASH_AGREEMENT[name], f"{name}: {agree} of {total}"


@pytest.mark.parametrize("family", NEW_FAMILIES, indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_engine_auto_routes_each_family_and_its_greedy_ids_equal_transformers(family):
    """moedesk's Engine opens each GGUF with engine="auto": llama.cpp where the native engine does not run the
    architecture (and says so), native where it does (three prompts decoded together). Its greedy ids equal
    transformers', except where llama.cpp's flash attention does not agree with transformers on every token
    (FLASH_AGREEMENT below 1): there they equal llama-cpp-python's own flash-attention greedy ids, and the
    agreement with transformers is the test above. A family the native engine runs is asked of llama.cpp too."""
    from tokenizers import Tokenizer

    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    name, built, _, flash = family
    arch = FAMILIES[name].gguf_arch
    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    expected = [hf_greedy(built.model, tokenizer.encode(p).ids, NEW_TOKENS, eos_ids=(EOS,)) for p in PROMPTS]
    if FLASH_AGREEMENT[name] < 1:
        on_llama_cpp = [llama_greedy(flash, tokenizer.encode(p).ids, NEW_TOKENS) for p in PROMPTS]
    else:
        on_llama_cpp = expected
    if arch in NATIVE_ARCHITECTURES:
        runs = [("auto", "native", expected), ("llama.cpp", "llama.cpp", on_llama_cpp)]
    else:
        runs = [("auto", "llama.cpp", on_llama_cpp)]
    for requested, kind, expected in runs:
        engine = Engine.load(str(built.gguf), engine=requested, context_length=128)
        try:
            assert engine.kind == kind, engine.why
            if requested == "auto" and kind == "llama.cpp":
                assert f"architecture {arch!r}" in engine.why, engine.why
            requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
                        for p in PROMPTS]
            assert [r.prompt_ids for r in requests] == [tokenizer.encode(p).ids for p in PROMPTS]
            assert [c.token_ids for c in engine.complete(requests)] == expected, f"{name} on {kind}"
        finally:
            getattr(engine, "close", lambda: None)()  # the llama.cpp engine frees its context; native has none

@pytest.mark.parametrize("family", ["gpt-oss-mxfp4"], indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_native_gpt_oss_mxfp4_gguf_agrees_with_llama_cpp_on_the_same_file(family):
    """The file `auto` now runs natively, against llama.cpp's logits on the same file (transformers' greedy paths,
    teacher-forced): with the experts computed exactly (their MXFP4 values dequantised) and with every expert in RAM
    through the packed kernel. llama.cpp rounds activations to 8 bits for MXFP4 dot products and the kernel does
    too, so the criterion is the other MXFP4 tests': mean error within 10% of the logits' spread, top-1 the same at
    90% of positions (docs/measurements.md has the figures)."""
    from tests.model.test_families import teacher_forced

    name, built, llm, _ = family
    paths, (exact, in_ram) = greedy_paths(built), native_engines(built)
    for engine in (exact, in_ram):
        assert engine.kind == "native" and "gpt_oss" in engine.why
        stacks = engine.model.moe_blocks()[0].experts
        assert (stacks.gate_up_format, stacks.down_format) == ("mxfp4", "mxfp4")
        errors, agree = [], []
        for ids in paths:
            theirs = llama_logits(llm, ids)
            ours = teacher_forced(engine, ids).numpy()
            errors.append(float(np.abs(ours - theirs).mean() / theirs.std()))
            agree += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
        print(f"native {'in RAM' if engine is in_ram else 'exact'} vs llama.cpp on {name}: mean logit error "
              f"{max(errors):.4f} of their spread, top-1 {np.mean(agree):.3f}")
        assert max(errors) <= 0.1 and np.mean(agree) >= 0.9, (errors, np.mean(agree))
    assert in_ram.executor.stats.cpu_experts > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss-mxfp4"], indirect=True)
def test_native_gpt_oss_mxfp4_gguf_on_cuda_agrees_with_llama_cpp(family, tmp_path, monkeypatch):
    """The same comparison on the GPU: every expert resident, computed packed by kernels.gpu_quant (never the
    dequantising reference), in float32, against llama.cpp's CPU logits on the same file; the same bound."""
    from tokenizers import Tokenizer

    from tests.model.test_families import teacher_forced
    from tests.model.test_gpt_oss_gpu import load_on_gpu

    name, built, llm, _ = family
    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    engine, calls = load_on_gpu(built.gguf, "float32", monkeypatch, tmp_path)
    assert engine.kind == "native" and next(iter(engine.executor.banks.values())).gpu.describe() == "mxfp4"
    errors, agree = [], []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        ids += hf_greedy(built.model, ids, NEW_TOKENS)[:-1]
        theirs, ours = llama_logits(llm, ids), teacher_forced(engine, ids).numpy()
        errors.append(float(np.abs(ours - theirs).mean() / theirs.std()))
        agree += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
    print(f"native on CUDA vs llama.cpp on {name}: mean logit error {max(errors):.4f} of their spread, "
          f"top-1 {np.mean(agree):.3f}")
    assert max(errors) <= 0.1 and np.mean(agree) >= 0.9, (errors, np.mean(agree))
    assert calls and set(calls) == {"gpu_quant.grouped_experts_forward"}, set(calls)


def routed_expert_bytes(config, mxfp4: bool = False) -> int:
    """The routed experts' bytes, by hand from the transformers config: float32, or MXFP4 (17 bytes per 32)."""
    h = config.hidden_size
    if config.model_type == "gpt_oss":  # every layer; float32 biases on gate, up and down
        f, experts, moe_layers = config.intermediate_size, config.num_local_experts, config.num_hidden_layers
        matrices = 3 * h * f * 17 // 32 if mxfp4 else 3 * h * f * 4
        return moe_layers * experts * (matrices + (2 * f + h) * 4)
    f = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = next(getattr(config, k) for k in ("n_routed_experts", "num_experts", "num_local_experts")
                   if getattr(config, k, None))
    dense = getattr(config, "first_k_dense_replace", None) or getattr(config, "num_dense_layers", None) or 0
    if getattr(config, "mlp_layer_types", None):  # GLM-4.7-Flash: a type per layer
        dense = config.mlp_layer_types.count("dense")
    moe_layers = config.num_hidden_layers - dense
    return moe_layers * experts * 3 * h * f * 4


@pytest.mark.parametrize("family", NEW_FAMILIES, indirect=True)
def test_memory_estimate_is_what_the_engine_auto_picks_holds(family):
    """The Models screen and the download wizard size a GGUF as the engine `auto` picks holds it. llama.cpp: the
    file's tensors as they are, the routed experts as counted by hand, the whole as llama.cpp's own
    llama_model_size, from the file or from its header's bytes alone. The native engine: experts as the loaded
    engine holds them (16-bit from these float32 files; MXFP4 ones stay packed)."""
    from moedesk.app.tui.catalog import gguf_model
    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES
    from moedesk.engine.load.gguf_header import parse_header
    from moedesk.engine.load.size_estimate import FileWeights, summarize_gguf_header, summarize_path

    name, built, llm, _ = family
    weights = summarize_path(built.gguf)
    estimate = weights.estimate("auto", "bfloat16")
    listed = gguf_model(built.gguf)
    assert (listed.arch, listed.estimate_error) == (FAMILIES[name].gguf_arch, "")
    assert listed.estimate("auto", "bfloat16") == estimate
    mxfp4 = name.endswith("mxfp4")
    if FAMILIES[name].gguf_arch in NATIVE_ARCHITECTURES:
        from moedesk.engine.runtime import Engine

        assert not isinstance(weights, FileWeights)
        engine = Engine.load(str(built.gguf), device="cpu", dtype="bfloat16")
        assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
        assert estimate.experts_as == ("mxfp4" if mxfp4 else "bf16")
        if not mxfp4 and "gpt" not in name:  # gpt-oss's expert biases are counted with the other weights
            assert estimate.expert_bytes == routed_expert_bytes(built.model.config) // 2
        return

    assert estimate.expert_bytes == routed_expert_bytes(built.model.config, mxfp4)
    assert estimate.total_bytes == llama_cpp.llama_model_size(llm._model.model)
    assert estimate.experts_as == ("mxfp4" if mxfp4 else "f32")
    assert listed.estimate("int4", "float16") == estimate  # the file's own formats, whatever dtype is chosen

    data = built.gguf.read_bytes()
    header_only = summarize_gguf_header(parse_header(data[:len(data) - estimate.total_bytes], built.gguf), built.gguf)
    assert header_only.estimate() == estimate


def test_mxfp4_repacking_keeps_every_weight():
    """gguf_from_hf's MXFP4 repacking (the Hub's nibble order to GGUF's) against two dequantizers nobody here
    wrote: transformers' of the Hub's blocks and the gguf package's of the GGUF rows, equal bit for bit."""
    import gguf
    from gguf.quants import dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.gguf_from_hf import mxfp4_to_gguf

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)  # 3 experts, 8 rows of 64
    scales = torch.randint(110, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    hub = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [experts, rows, 64]
    ours = dequantize(mxfp4_to_gguf(blocks, scales).numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(ours, hub.numpy()) and np.abs(ours).max() > 0


def test_a_gpt_oss_gguf_without_a_template_gets_harmonys_on_llama_cpp(tmp_path):
    from moedesk.engine.load.harmony import HARMONY_TEMPLATE
    from moedesk.engine.runtime import Engine
    from tests.gguf_from_hf import write_gguf
    from tests.tiny_models import CHAT_TEMPLATE

    built = build("gpt-oss", tmp_path / "oss")
    bare = write_gguf("gpt-oss", built.folder, tmp_path / "bare.gguf", chat_template=None)
    for path, template in ((bare, HARMONY_TEMPLATE), (built.gguf, CHAT_TEMPLATE)):  # its own template always wins
        engine = Engine.load(str(path), engine="llama.cpp", context_length=128)
        try:
            assert engine.tokenizer.chat_template == template
            harmony = engine.tokenizer.reply_format.tools == "harmony"
            assert harmony == (template is HARMONY_TEMPLATE)
            if harmony:
                assert engine.tokenizer.render_chat([{"role": "user", "content": "Hi"}], reasoning_effort="low"
                                                    ).endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
                # a streamed reply is decoded a token at a time, its special tokens kept (the server's raw text)
                ids = engine.tokenizer.encode("<|channel|>final<|message|>Hi é<|return|>", add_special_tokens=False)
                decoder = engine.tokenizer.stream_decoder(skip_special_tokens=False)
                assert "".join(decoder.step(i) for i in ids) == engine.tokenizer.decode(ids, skip_special_tokens=False)
                assert "<|message|>" in engine.tokenizer.decode(ids, skip_special_tokens=False)
        finally:
            engine.close()


@pytest.mark.parametrize("family", ["minimax-m2"], indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_native_minimax_m2_gguf_agrees_with_llama_cpp_on_the_same_file(family):
    """The file `auto` runs natively, against llama.cpp's logits on the same file (transformers' greedy paths,
    teacher-forced), experts in memory and in RAM: float32 weights on both sides, so the bound is the one llama.cpp
    meets against transformers (LOGIT_TOLERANCE), and the next token is llama.cpp's wherever its two best logits are
    further apart than that."""
    from tests.model.test_families import teacher_forced

    name, built, llm, _ = family
    paths, (resident, in_ram) = greedy_paths(built), native_engines(built)
    for engine in (resident, in_ram):
        assert engine.kind == "native" and engine.config.arch == "minimax_m2"
        gaps, agree = [], []
        for ids in paths:
            theirs = llama_logits(llm, ids)
            ours = teacher_forced(engine, ids).numpy()
            gaps.append(float(np.abs(ours - theirs).max()))
            top2 = np.sort(theirs, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > LOGIT_TOLERANCE
            assert clear.mean() > 0.9 and (ours.argmax(-1) == theirs.argmax(-1))[clear].all()
            agree += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
        print(f"native {'in RAM' if engine is in_ram else 'resident'} vs llama.cpp on {name}: logits at most "
              f"{max(gaps):.1e} apart, top-1 {np.mean(agree):.3f}")
        assert max(gaps) < LOGIT_TOLERANCE, gaps
    assert in_ram.executor.stats.cpu_experts > 0
