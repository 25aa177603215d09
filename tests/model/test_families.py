"""The MoE families of issue 41 against references nobody here wrote: transformers' modules and models on tiny
random configs, and llama.cpp (llama-cpp-python) on GGUF files written with the gguf package's own tensor names.

tests/model/test_equivalence.py runs every architecture of tests/tiny_models.py through the common checks
(last-position logits, batched greedy generation); this module checks what is particular to each family: its
routing rule on its own, offloaded experts, the checkpoint layers it does not run, and its GGUF names.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.model.routing import grouped_sigmoid_top_k
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model, llama_greedy
from tests.tiny_models import SPECIAL, budget_for_experts

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


def greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)],
                                                        batch_size=2)}
    return [done[i] for i in range(len(prompts))]


def each_policy(engine: Engine):
    """Every offloaded expert copied to the (simulated) GPU, then every one computed on the CPU: yields each policy's
    name with the executor's stats reset."""
    for policy, decide in (("copy", lambda loads: ([], sorted(loads))), ("cpu", lambda loads: (sorted(loads), []))):
        engine.executor.decide = decide
        engine.executor.stats = type(engine.executor.stats)()
        yield policy


def teacher_forced(engine: Engine, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of every position of ids, in one forward pass."""
    cache = engine.model.new_cache(1, len(ids), engine.dtype, engine.device)
    positions = torch.arange(len(ids), device=engine.device)[None]
    return engine.model(torch.tensor([ids], device=engine.device), positions, cache, engine.executor)[0].float().cpu()


def assert_int8_logits_close(pairs, what: str) -> None:
    """(ours, exact) [T, V] logits along the same tokens, ours from a run that rounds activations to int8 per 32
    values (kernels/cpu_quant.c, the GPU's integer route), as llama.cpp does: the mean error within 10% of the
    logits' spread and the same top-1 at 90% of positions (why: test_gpt_oss_mxfp4_experts_stay_packed's docstring)."""
    errors, agreement = [], []
    for ours, exact in pairs:
        errors.append(float((ours - exact).abs().mean() / exact.std()))
        agreement += (ours.argmax(-1) == exact.argmax(-1)).tolist()
    print(f"{what}: mean logit error {max(errors):.4f} of their spread, top-1 {np.mean(agreement):.3f}")
    assert max(errors) <= 0.1 and np.mean(agreement) >= 0.9, (errors, np.mean(agreement))


def reference_greedy(folder, engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    return [hf_greedy(hf_model(folder), p, tokens, eos) for p in prompts]


# --- the sigmoid, group-limited routing of DeepSeek-V3 and GLM-4.x -------------------------------------------

@pytest.mark.parametrize("groups, top_groups, renormalise", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_grouped_sigmoid_routing_matches_the_glm4_moe_router(groups, top_groups, renormalise):
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = transformers.Glm4MoeConfig(hidden_size=32, n_routed_experts=32, num_experts_per_tok=6, n_group=groups,
                                        topk_group=top_groups, norm_topk_prob=renormalise, routed_scaling_factor=2.5)
    router = Glm4MoeTopkRouter(config)
    torch.manual_seed(groups)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)  # large enough to change choices
    x = torch.randn(200, 32)
    _, their_weights, their_ids = router(x)
    weights, ids = grouped_sigmoid_top_k(x @ router.weight.T, router.e_score_correction_bias, 6, groups, top_groups,
                                         renormalise, 2.5)
    order = their_ids.argsort(dim=-1)
    assert torch.equal(ids, their_ids.gather(1, order))
    torch.testing.assert_close(weights, their_weights.gather(1, order), rtol=1e-6, atol=1e-7)
    # The correction bias picks experts but does not weigh them: without it the choice changes somewhere.
    _, plain_ids = grouped_sigmoid_top_k(x @ router.weight.T, torch.zeros(32), 6, groups, top_groups, renormalise, 2.5)
    assert not torch.equal(plain_ids, ids)
    if groups > 1:  # every token's experts lie in at most top_groups groups
        assert max(len(set((row // (32 // groups)).tolist())) for row in ids) <= top_groups


# --- glm4_moe ----------------------------------------------------------------------------------------------

def test_glm4_moe_offloaded_generates_the_reference_tokens(tiny_checkpoint):
    """Experts in RAM on the simulated GPU tier, none and some of them resident: transformers' tokens."""
    folder = tiny_checkpoint("glm4_moe")
    for budget in (0, budget_for_experts(folder, 5)):  # GiB: none, and about a third of the 16 experts
        engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=budget)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        expected = reference_greedy(folder, engine, prompts, 16)
        for policy in each_policy(engine):
            assert greedy(engine, prompts, 16) == expected, (budget, policy)
            stats = engine.executor.stats
            assert (stats.cpu_experts > 0) == (policy == "cpu") and (stats.gpu_experts > 0) == (budget > 0)


def test_glm4_moe_dense_first_layers_and_its_mtp_layer(tiny_checkpoint, tmp_path):
    """first_k_dense_replace makes the first layers dense; a checkpoint's multi-token prediction layer (GLM-4.5
    ships one after the last layer) is read past, not loaded, and changes nothing."""
    import shutil

    from safetensors.torch import save_file

    folder = tiny_checkpoint("glm4_moe")
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    assert [hasattr(b, "moe") for b in engine.model.layers] == [False, True, True]
    mtp = tmp_path / "with-mtp"
    shutil.copytree(folder, mtp)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        layer = {k.replace("layers.2.", "layers.3."): f.get_tensor(k) for k in f.keys() if ".layers.2." in k}
    layer["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(layer, str(mtp / "mtp.safetensors"))
    with_mtp = Engine.load(str(mtp), device="cpu", dtype="float32")
    assert with_mtp.config.num_layers == 3 and with_mtp.config.mtp_layers == 1
    ids = engine.tokenizer.encode(PROMPTS[1])
    assert torch.equal(last_logits(with_mtp, ids), last_logits(engine, ids))


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    cache = KVCache(engine.config, 1, len(ids), torch.float32, "cpu")
    return engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, engine.executor)[0, -1]


def test_glm4_moe_keeps_its_router_in_float32(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("glm4_moe")), device="cpu", dtype="bfloat16")
    moe = engine.model.moe_blocks()[0]
    assert moe.router.weight.dtype == moe.score_bias.dtype == torch.float32
    assert engine.model.layers[0].attn.wq.weight.dtype == torch.bfloat16


# --- GGUF, as llama.cpp's converter names it ------------------------------------------------------------------

def write_gguf(folder, path, arch: str) -> None:
    """A GGUF file of the tiny checkpoint in `folder`, as llama.cpp's converter writes it: the gguf package's tensor
    names for `arch`, routed experts stacked per projection, the byte-level vocabulary with its merges."""
    import gguf

    hf = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).numpy() for k in f.keys()}
    layers, experts = hf["num_hidden_layers"], hf["n_routed_experts"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers); w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"]); w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"]); w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(head_dim); w.add_value_length(head_dim)
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"]); w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_dimension_count(int(head_dim * hf["rope_parameters"]["partial_rotary_factor"]))
    w.add_vocab_size(hf["vocab_size"]); w.add_expert_count(experts); w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"]); w.add_expert_shared_count(hf["n_shared_experts"])
    w.add_leading_dense_block_count(hf["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hf["routed_scaling_factor"]); w.add_expert_weights_norm(hf["norm_topk_prob"])
    w.add_expert_group_count(hf["n_group"]); w.add_expert_group_used_count(hf["topk_group"])
    w.add_nextn_predict_layers(0)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    tokens[:len(SPECIAL)] = SPECIAL
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-2"); w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    w.add_bos_token_id(hf["bos_token_id"]); w.add_eos_token_id(hf["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers)
    for layer in range(layers):
        for proj in ("gate", "up", "down"):
            key = f"model.layers.{layer}.mlp.experts.0.{proj}_proj.weight"
            if key in tensors:
                stack = np.stack([tensors.pop(key.replace(".0.", f".{e}.")) for e in range(experts)])
                w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", stack)
        bias = tensors.pop(f"model.layers.{layer}.mlp.gate.e_score_correction_bias", None)
        if bias is not None:  # llama.cpp's converter renames it "e_score_correction.bias" first
            w.add_tensor(names.get_name(f"model.layers.{layer}.mlp.gate.e_score_correction.bias",
                                        try_suffixes=(".weight", ".bias")), bias)
    for name, array in tensors.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_glm4_moe_gguf_generates_the_reference_tokens(tiny_checkpoint, tmp_path):
    """The same weights as glm4moe GGUF: moedesk's tokens equal transformers' on the safetensors, and the memory
    estimate from the file's header equals what loading it allocates."""
    from moedesk.engine.load.size_estimate import summarize_path

    folder = tiny_checkpoint("glm4_moe")
    path = tmp_path / "tiny-glm4moe.gguf"
    write_gguf(folder, path, "glm4moe")
    engine = Engine.load(str(path), device="cpu", dtype="float32")
    ours = Engine.load(str(folder), device="cpu", dtype="float32")
    # The file has no MTP layer, so it says none; transformers' config.json says one that it does not save.
    assert dataclasses.replace(engine.config, mtp_layers=1) == ours.config
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert [engine.tokenizer.encode(p) for p in PROMPTS] == prompts
    assert greedy(engine, prompts, 16) == reference_greedy(folder, ours, prompts, 16)
    estimate = summarize_path(path).estimate("auto", "float32")
    assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())


def test_glm4_moe_gguf_generates_like_llama_cpp(tiny_checkpoint, tmp_path):
    """llama.cpp runs the same file: its greedy tokens are moedesk's (and so transformers')."""
    llama_cpp = pytest.importorskip("llama_cpp")
    folder = tiny_checkpoint("glm4_moe")
    path = tmp_path / "tiny-glm4moe.gguf"
    write_gguf(folder, path, "glm4moe")
    engine = Engine.load(str(path), device="cpu", dtype="float32")
    reference = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    for text in PROMPTS[1:]:
        ids = engine.tokenizer.encode(text)
        assert ids == reference.tokenize(text.encode(), add_bos=False, special=True)
        done = next(engine.generate([Request(ids, SamplingParams(max_new_tokens=12, temperature=0))]))
        theirs = llama_greedy(reference, ids, 12, stop={2})
        assert theirs and done.token_ids == theirs, text


def test_bench_runs_a_glm_shape_on_the_simulated_tier():
    """`moedesk bench --shape glm-4.5-air`'s path (a dense first layer, sigmoid routing, a shared expert) at a size
    the CPU runs; the full shape's figures come from the GPU box."""
    from moedesk.bench.budget import budget_for_experts
    from moedesk.bench.synthetic import bench_context, run_bench
    from moedesk.engine.load.synthetic import SHAPES, shape_config

    budget = budget_for_experts(shape_config("tiny-glm", 3), 4, bench_context((16,), 6), "dense", "cpu")
    report = run_bench("tiny-glm", 3, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=2,
                       log=lambda *a: None)
    assert [r["mode"] for r in report["results"]] == ["decode", "prefill", "batched_decode"]
    assert all(r["tok_s"] > 0 for r in report["results"])
    air = shape_config("glm-4.5-air", layers=8)
    assert air.moe_layers == (False,) + (True,) * 7 and SHAPES["glm-4.5-air"].rope_dims == 64


def test_bench_stores_a_down_projection_q4_k_does_not_tile_as_q4_0_and_says_so(monkeypatch):
    """GLM-4.5-Air's experts are 1408 wide: not whole q4_k blocks of 256. The bench keeps gate/up q4_k and stores down
    as q4_0 (llama.cpp's quantiser falls back per tensor likewise), runs, and says so in its report."""
    from moedesk.bench.synthetic import format_results, run_bench
    from moedesk.engine.load import synthetic

    air = synthetic.SHAPES["glm-4.5-air"]
    assert synthetic.expert_formats("q4_k", air.hidden_size, air.moe_intermediate_size) == ("q4_k", "q4_0")
    # GLM-4.5-Air's switches with rows of 256 (gate/up) and 96 (down) weights: a size the CPU runs
    small = dataclasses.replace(synthetic.SHAPES["tiny-glm"], hidden_size=256, moe_intermediate_size=96)
    monkeypatch.setitem(synthetic.SHAPES, "tiny-glm-96", small)
    lines = []
    report = run_bench("tiny-glm-96", 2, 0.0, device="cpu", decode_tokens=4, prefill=(8,), batch=1,
                       log=lines.append, expert_format="q4_k")
    assert report["experts"] == "q4_k/q4_0" and all(r["tok_s"] > 0 for r in report["results"])
    note = "down projection: rows of 96 weights are not whole q4_k blocks of 256, stored as q4_0"
    assert any(note in line for line in lines) and note in format_results(report)


# --- gpt_oss -----------------------------------------------------------------------------------------------

def test_gpt_oss_prompts_past_the_window_offloaded_and_in_ram(tiny_checkpoint):
    """Sliding layers (window 8) and full ones alternate: prompts longer than the window, in one batch with a short
    one, generate transformers' tokens with the experts (biases, clamped SwiGLU) in RAM or offloaded."""
    folder = tiny_checkpoint("gpt_oss")
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert engine.config.sliding_window == 8 and max(map(len, prompts)) > 3 * 8
    expected = reference_greedy(folder, engine, prompts, 20)
    assert greedy(engine, prompts, 20) == expected
    offloaded = Engine.load(str(folder), device="cpu", dtype="float32", offload=True,
                            gpu_budget=budget_for_experts(folder, 2))
    for policy in each_policy(offloaded):
        assert greedy(offloaded, prompts, 20) == expected, policy
        stats = offloaded.executor.stats
        assert stats.gpu_experts > 0 and (stats.cpu_experts > 0) == (policy == "cpu")


def test_gpt_oss_routing_matches_its_router():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from moedesk.engine.model.routing import top_k_softmax

    router = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.bias.normal_(0, 0.3)
    x = torch.randn(100, 32)
    logits, their_weights, their_ids = router(x)
    weights, ids = top_k_softmax(logits, 4)
    order = their_ids.argsort(dim=-1)
    assert torch.equal(ids, their_ids.gather(1, order))
    assert torch.equal(weights, their_weights.gather(1, order))


def mxfp4_checkpoint(folder, out):
    """`folder`'s tiny gpt-oss with its experts replaced by random MXFP4 blocks and scales, laid out as the released
    checkpoints lay them out (gate_up_proj_blocks [E, 2F, H/32, 16], *_scales [E, 2F, H/32], down likewise), and a
    quantization_config saying so."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(folder, out)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(5)
    H, F = config["hidden_size"], config["intermediate_size"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E = tensors.pop(name).shape[0]
        rows, k = (2 * F, H) if name.endswith("gate_up_proj") else (H, F)
        tensors[name + "_blocks"] = torch.from_numpy(rng.integers(0, 256, (E, rows, k // 32, 16), dtype=np.uint8))
        tensors[name + "_scales"] = torch.from_numpy(rng.integers(121, 126, (E, rows, k // 32), dtype=np.uint8))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def native_packed_calls(monkeypatch, what: str) -> list[tuple[str, bool]]:
    """(format, plain) of each call of cpu_quant's native routed kernel from here on; a call of the dequantising
    reference path fails the test, naming `what` took it."""
    from moedesk.kernels import cpu_quant, experts

    calls = []
    native = cpu_quant.experts_forward_routed

    def counted(x, pair_expert, k, chosen, w, *args, **kwargs):
        calls.append((w.gate_up_format, w.plain))
        return native(x, pair_expert, k, chosen, w, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError(f"{what} took the dequantising reference path")

    monkeypatch.setattr(cpu_quant, "experts_forward_routed", counted)
    monkeypatch.setattr(experts, "reference_routed", refused)
    return calls


def test_gpt_oss_mxfp4_experts_stay_packed_and_generate_the_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    """A checkpoint whose experts are MXFP4 as released: moedesk keeps them packed (4.25 bits a weight) and computes
    them, giving the tokens of transformers, which dequantises them on load (with the native kernels off, each expert
    is computed through dequantisation, exact to float32).

    With the kernels on (a CPU load, and the experts in RAM offloaded, every expert computed where it lives) they take
    the native packed kernel,
    biases and clamped SwiGLU included (kernels/cpu_quant.c), never the dequantising reference. That kernel rounds
    activations to int8 per 32 values, as llama.cpp's does: on this tiny random model, whose random experts' outputs
    are ~17x the residual stream, that is ~3% of each expert's output (measured 2.7-4.5%), enough to flip a near-tie
    among the 512 tokens or a routing choice later in a greedy run. So the kernel's logits are checked against the
    exact ones on transformers' own greedy sequences (teacher-forced): the mean error within 10% of the logits'
    spread (measured 5.1% at worst) and the next token the same at 90% of positions (measured 93%)."""
    import transformers

    from moedesk.kernels import cpu_quant

    folder = mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # the dequantising reference: exact to float32
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    stacks = engine.model.moe_blocks()[0].experts
    assert (stacks.gate_up_format, stacks.down_format) == ("mxfp4", "mxfp4") and not stacks.plain
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(reference, p, 16, eos) for p in prompts]
    assert greedy(engine, prompts, 16) == expected
    sequences = [prompt + continuation for prompt, continuation in zip(prompts, expected)]
    exact = [teacher_forced(engine, ids) for ids in sequences]

    monkeypatch.delenv("MOEDESK_NO_NATIVE_KERNELS")
    if not cpu_quant.available():
        pytest.skip(f"no native packed kernel here: {cpu_quant.unavailable_reason()}")
    in_ram = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    in_ram.executor.decide = lambda loads: (sorted(loads), [])  # every expert computed where it lives, in RAM
    calls = native_packed_calls(monkeypatch, "gpt-oss's MXFP4 experts")
    assert_int8_logits_close([(teacher_forced(in_ram, ids), ref) for ids, ref in zip(sequences, exact)],
                             "gpt-oss MXFP4 in RAM")
    local = [teacher_forced(engine, ids) for ids in sequences]  # a CPU load's executor takes the kernel too
    assert_int8_logits_close(list(zip(local, exact)), "gpt-oss MXFP4 on a CPU load")
    assert calls and set(calls) == {("mxfp4", False)} and in_ram.executor.stats.cpu_experts > 0
    # The estimate from the headers alone sizes the packed stacks as loaded: 17 bytes per 32 weights.
    from moedesk.engine.load.size_estimate import summarize_path

    estimate = summarize_path(folder).estimate("auto", "float32")
    assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert estimate.experts_as == "mxfp4"


# --- deepseek_v3 -------------------------------------------------------------------------------------------

def test_deepseek_v3_latent_attention_offloaded_and_its_switches(tiny_checkpoint):
    """MLA in its plain form (every head's key and value cached) with the group-limited routing, experts offloaded:
    transformers' tokens. The softmax scale (yarn's mscale squared) and the query bottleneck are really used."""
    folder = tiny_checkpoint("deepseek_v3")
    engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True,
                         gpu_budget=budget_for_experts(folder, 2))
    cfg = engine.config
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.v_head_dim, cfg.rope_dims) == (24, 32, 24, 12, 8)
    assert cfg.attention_scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = reference_greedy(folder, engine, prompts, 16)
    for policy in each_policy(engine):
        assert greedy(engine, prompts, 16) == expected, policy
    assert [hasattr(b, "moe") for b in engine.model.layers] == [False, True, True]


@pytest.mark.parametrize("shape", ["gpt-oss-120b", "gpt-oss-20b", "deepseek-v3", "minimax-m2"])
def test_bench_shapes_of_gpt_oss_and_deepseek_build_and_run_at_a_cpu_size(shape):
    """The real shapes' switches (sinks and windows, biased MXFP4 experts; MLA and grouped routing) through the
    synthetic model the benchmark builds, shrunk to a size the CPU runs: its forward pass gives finite logits."""
    from moedesk.engine.load.synthetic import SHAPES, synthetic_model
    from moedesk.engine.offload.expert_executor import LocalExecutor

    real = SHAPES[shape]
    small = dataclasses.replace(real, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_experts=8,
                                num_kv_heads=4 if real.kv_lora_rank else 2, moe_intermediate_size=64,
                                intermediate_size=64, moe_layers=real.moe_layers[:4],
                                sliding_layers=real.sliding_layers[:4], sliding_window=min(real.sliding_window, 4),
                                n_group=min(real.n_group, 4), topk_group=min(real.topk_group, 2),
                                num_experts_per_tok=min(real.num_experts_per_tok, 2),
                                shared_expert_intermediate_size=64 if real.shared_expert_intermediate_size else 0,
                                q_lora_rank=32 if real.q_lora_rank else 0, kv_lora_rank=32 if real.kv_lora_rank else 0,
                                v_head_dim=16 if real.v_head_dim else 0)
    fmt = "mxfp4" if shape.startswith("gpt-oss") else "dense"
    model, banks = synthetic_model(small, torch.float32, "cpu", pinned=False, context=64, expert_format=fmt)
    assert all(not w.plain for w in banks.values()) == shape.startswith("gpt-oss")
    cache = model.new_cache(1, 12, torch.float32, "cpu")
    logits = model(torch.arange(12)[None], torch.arange(12)[None], cache, LocalExecutor())
    assert logits.shape == (1, 12, 256) and torch.isfinite(logits).all()


def test_bench_gpt_oss_mxfp4_experts_in_ram_take_the_native_kernel(monkeypatch):
    """`moedesk bench --shape gpt-oss-120b --expert-format mxfp4 --gpu-budget 0`'s path at a size the CPU runs: every
    expert in RAM, computed by the native packed kernel (biases and clamped SwiGLU in the call), never through the
    dequantising reference; the bound it reports reads 17 bytes per 32 weights."""
    from moedesk.bench.synthetic import run_bench
    from moedesk.engine.load import synthetic
    from moedesk.kernels import cpu_quant

    if not cpu_quant.available():
        pytest.skip(f"no native packed kernel here: {cpu_quant.unavailable_reason()}")
    real = synthetic.SHAPES["gpt-oss-120b"]
    small = dataclasses.replace(real, vocab_size=512, hidden_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                                head_dim=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64,
                                intermediate_size=64, moe_layers=real.moe_layers[:4],
                                sliding_layers=real.sliding_layers[:4], sliding_window=8)
    monkeypatch.setitem(synthetic.SHAPES, "tiny-gpt-oss", small)
    calls = native_packed_calls(monkeypatch, "the bench's MXFP4 experts")
    report = run_bench("tiny-gpt-oss", 4, 0, device="cpu", decode_tokens=6, prefill=(16,), batch=2,
                       log=lambda *a: None, expert_format="mxfp4")
    assert [r["mode"] for r in report["results"]] == ["decode", "prefill", "batched_decode"]
    assert all(r["tok_s"] > 0 for r in report["results"])
    assert calls and set(calls) == {("mxfp4", False)}
    assert report["experts"] == "mxfp4" and report["profile"]["expert_bytes"] == 3 * 64 * 96 * 17 // 32


def test_gpt_oss_gguf_generates_the_reference_tokens(tmp_path):
    """gpt-oss as llama.cpp's converter writes it (tests/gguf_from_hf.py: gate and up apart, stacked biases, sinks,
    yarn, the window): the native engine, which `auto` picks for it, loads it and gives transformers' tokens on the
    same weights (tests/llamacpp/test_new_archs.py compares it with llama.cpp on MXFP4 experts)."""
    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES
    from tests.gguf_from_hf import build

    built = build("gpt-oss", tmp_path / "gpt-oss")
    assert "gpt-oss" in NATIVE_ARCHITECTURES
    engine = Engine.load(str(built.gguf), device="cpu", dtype="float32")
    assert engine.kind == "native" and engine.config.sliding_layers == (True, False, True, False)
    ours = Engine.load(str(built.folder), device="cpu", dtype="float32")
    assert engine.config == ours.config
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    eos = ours.tokenizer.eos_token_ids | set(ours.config.eos_token_ids)
    assert greedy(engine, prompts, 16) == [hf_greedy(built.model, p, 16, eos) for p in prompts]


def test_gpt_oss_norms_round_where_the_reference_rounds():
    """gpt-oss's RMSNorm applies its weight in float32 and rounds after it; in bfloat16 that differs from the
    other families' order, and moedesk's norm for it equals the reference's bit for bit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from moedesk.engine.model.norm import RMSNorm

    torch.manual_seed(0)
    theirs, ours, others = GptOssRMSNorm(256, 1e-5), RMSNorm(256, 1e-5, weight_first=True), RMSNorm(256, 1e-5)
    with torch.no_grad():
        theirs.weight.normal_(1, 0.3)
        ours.weight.copy_(theirs.weight)
        others.weight.copy_(theirs.weight)
    theirs, ours, others = theirs.bfloat16(), ours.bfloat16(), others.bfloat16()
    x = torch.randn(64, 256).bfloat16()
    assert torch.equal(ours(x), theirs(x)) and not torch.equal(others(x), theirs(x))


# --- minimax_m2 --------------------------------------------------------------------------------------------

def test_minimax_m2_routing_matches_its_router():
    """Sigmoid scores, chosen with the correction bias, weighted without it and renormalised: the grouped rule with
    one group and no scaling is MiniMax-M2's router, bit for bit."""
    import transformers
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    router = MiniMaxM2TopKRouter(transformers.MiniMaxM2Config(hidden_size=32, num_local_experts=16,
                                                              num_experts_per_tok=4))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
    bias = torch.randn(16) * 0.2  # large enough to change choices
    x = torch.randn(200, 32)
    _, their_weights, their_ids = router(x, bias)
    weights, ids = grouped_sigmoid_top_k(x @ router.weight.T, bias, 4, 1, 1, True, 1.0)
    order = their_ids.argsort(dim=-1)
    assert torch.equal(ids, their_ids.gather(1, order))
    torch.testing.assert_close(weights, their_weights.gather(1, order), rtol=1e-6, atol=1e-7)
    _, plain_ids = grouped_sigmoid_top_k(x @ router.weight.T, torch.zeros(16), 4, 1, 1, True, 1.0)
    assert not torch.equal(plain_ids, ids)


def test_minimax_m2_offloaded_and_its_multi_token_prediction_layers(tiny_checkpoint, tmp_path):
    """Experts in RAM, computed on the CPU or copied to the simulated GPU: transformers' tokens, the router and its
    correction bias kept in float32. A checkpoint's multi-token prediction modules (the released one's config says
    num_mtp_modules; vLLM reads them as layers after the last) are read past and change nothing."""
    import shutil

    from safetensors.torch import save_file

    folder = tiny_checkpoint("minimax_m2")
    engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True,
                         gpu_budget=budget_for_experts(folder, 4))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = reference_greedy(folder, engine, prompts, 16)
    for policy in each_policy(engine):
        assert greedy(engine, prompts, 16) == expected, policy
    moe = Engine.load(str(folder), device="cpu", dtype="bfloat16").model.moe_blocks()[0]
    assert moe.router.weight.dtype == moe.score_bias.dtype == torch.float32

    mtp = tmp_path / "with-mtp"
    shutil.copytree(folder, mtp)
    config = json.loads((folder / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**config, "use_mtp": True, "num_mtp_modules": 1}))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        layer = {k.replace("layers.2.", "layers.3."): f.get_tensor(k) for k in f.keys() if ".layers.2." in k}
    save_file(layer, str(mtp / "mtp.safetensors"))
    with_mtp = Engine.load(str(mtp), device="cpu", dtype="float32")
    plain = Engine.load(str(folder), device="cpu", dtype="float32")
    assert with_mtp.config.num_layers == 3 and with_mtp.config.mtp_layers == 1
    ids = plain.tokenizer.encode(PROMPTS[1])
    assert torch.equal(last_logits(with_mtp, ids), last_logits(plain, ids))
