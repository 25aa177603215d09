"""Checkpoints in the compressed-tensors format (engine/load/compressed_tensors.py), written here as the format's
description says and the releases lay them out: transformers' tiny random DeepSeek-V3 as Kimi-K2-Thinking ships it
(routed experts in 4-bit integers packed 8 to an int32, a bf16 scale per 32 weights of a row, weight_shape beside),
and its tiny GLM-4.5 as the FP8 releases do (float8_e4m3fn weights, a scale per output channel, per block or per
tensor). Packing and dequantising here are written from the format's description, not from moedesk's code; the
references are a float64 product per weight and transformers on the dequantised float32 copy."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.load import compressed_tensors as ct
from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.runtime import Engine
from moedesk.kernels.quant_formats import dequantize as dequantize_packed
from tests.model.test_families import greedy
from tests.reference import hf_greedy, hf_model
from tests.tiny_models import build

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
E4M3_MAX = 448.0
# Kimi-K2-Thinking's quantization_config: routed experts only, everything else named in ignore
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def int_weights(bits: int, group: int | None = 32, **extra) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if group else "channel",
            "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax", **extra}


def fp8_weights(strategy: str, block=None) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
            "block_structure": block, "group_size": None}


def ct_config(weights: dict, fmt: str, ignore=(), targets=("Linear",), inputs=None, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "kv_cache_scheme": None, "ignore": list(ignore), "sparsity_config": {},
            "config_groups": {"group_0": {"targets": list(targets), "weights": weights, "input_activations": inputs,
                                          "output_activations": None}}, **extra}


# --- the format, from its description --------------------------------------------------------------------------

def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [rows, ceil(cols / n)] of integers q [rows, cols] (n = 32 / bits): value i of a row, plus
    2^(bits - 1), in bits [bits * (i % n), ...) of word i // n; a short last word padded with zeros."""
    n = 32 // bits
    rows, cols = q.shape
    u = np.zeros((rows, math.ceil(cols / n) * n), dtype=np.uint64)
    u[:, :cols] = (q.numpy().astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    words = np.zeros((rows, u.shape[1] // n), dtype=np.uint64)
    for i in range(n):
        words |= u[:, i::n] << np.uint64(bits * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def scale_per(shape, block) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each block's scale over its block, float64, cut to the weight's shape."""
    s = scale.double().reshape(scale_per(shape, block))
    return s.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def quantise_int(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers int8, bf16 scales [rows, ceil(cols / group)]): each group's largest magnitude at the top integer."""
    top = (1 << (bits - 1)) - 1
    block = (1, group or w.shape[1])
    rows, cols = w.shape
    padded = torch.zeros(rows, scale_per(w.shape, block)[1] * block[1])
    padded[:, :cols] = w
    amax = padded.reshape(rows, -1, block[1]).abs().amax(-1)
    scale = torch.where(amax > 0, amax / top, 1.0).bfloat16()
    q = torch.round(w.double() / expand(scale, w.shape, block)).clamp(-top - 1, top).to(torch.int8)
    return q, scale


def quantise_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    block = (block[0] or rows, block[1] or cols)
    padded = torch.zeros(scale_per(w.shape, block)[0] * block[0], scale_per(w.shape, block)[1] * block[1])
    padded[:rows, :cols] = w
    amax = padded.reshape(padded.shape[0] // block[0], block[0], -1, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (w.double() / expand(scale, w.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def release(folder, out, quantization: dict, quantised, scheme, scale_shape=None):
    """`folder`'s checkpoint in the compressed-tensors format in `out`, every weight `quantised(name)` says stored
    per `scheme` (("int", bits, group) or ("float", (b0, b1)), None for all rows or columns); returns (out, the
    float32 dequantised copy's folder, {weight name: its float64 dequantised values})."""
    shutil.copytree(folder, out)
    copy = out.with_name(out.name + "-dequantised")
    shutil.copytree(folder, copy)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    tensors, exact = load_file(folder / "model.safetensors"), {}
    for name in [n for n in list(tensors) if quantised(n)]:
        w, module = tensors.pop(name).float(), name.removesuffix(".weight")
        if scheme[0] == "int":
            q, scale = quantise_int(w, scheme[1], scheme[2])
            tensors[module + ".weight_packed"] = pack(q, scheme[1])
            tensors[module + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
            exact[name] = q.double() * expand(scale, w.shape, (1, scheme[2] or w.shape[1]))
        else:
            q, scale = quantise_fp8(w, scheme[1])
            tensors[name] = q
            exact[name] = q.double() * expand(scale, w.shape, (scheme[1][0] or w.shape[0], scheme[1][1] or w.shape[1]))
            if scale_shape is not None:
                scale = scale.reshape(scale_shape)
        tensors[module + ".weight_scale"] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    plain = load_file(copy / "model.safetensors")
    save_file({n: exact[n].float() if n in exact else t.float() for n, t in plain.items()},
              str(copy / "model.safetensors"), metadata={"format": "pt"})
    return out, copy, exact


def routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def linear(name: str) -> bool:
    """What an "every Linear" release quantises: 2-D projections, not the router, embeddings, norms or lm_head."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def kimi_k2(folder, out, **kwargs):
    """A Kimi-K2-Thinking-style release of the tiny DeepSeek-V3 (model_type kimi_k2, as Moonshot's config says)."""
    out, copy, exact = release(folder, out, ct_config(int_weights(4), "pack-quantized", KIMI_IGNORE),
                               routed_expert, ("int", 4, 32), **kwargs)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return out, copy, exact


# --- the rule ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_gives_the_stored_integers(bits):
    """Awkward widths (a last word half full): each value as stored, q + 2^(bits - 1)."""
    gen = torch.Generator().manual_seed(bits)
    top = 1 << (bits - 1)
    q = torch.randint(-top, top, (5, 43), generator=gen, dtype=torch.int8)
    assert torch.equal(ct.unpack(pack(q, bits), bits, 43).to(torch.int16), q.to(torch.int16) + top)


@pytest.mark.parametrize("kind, block", [("int", (1, 32)), ("int", (1, 7)), ("int", (1, None)), ("float", (1, None)),
                                         ("float", (None, None)), ("float", (32, 40)), ("float", (1, 16))])
def test_each_weight_is_its_value_times_its_blocks_scale(kind, block):
    """Per group (partial at the row's end), channel, tensor and block: value by value, the float64 product, rounded
    once to the dtype asked for."""
    gen = torch.Generator().manual_seed(3)
    shape = (70, 83)
    b = (block[0] or shape[0], block[1] or shape[1])
    if kind == "int":
        values, offset = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8), 8
        numbers = values.double() - 8
        scale = (torch.rand(scale_per(shape, b), generator=gen) * 0.1).bfloat16()
    else:
        values, offset = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), 0
        numbers = values.double()
        scale = torch.rand(scale_per(shape, b), generator=gen) + 1e-3
    expected = torch.empty(shape, dtype=torch.float64)
    s = scale.double()
    for r in range(shape[0]):
        for c in range(shape[1]):
            expected[r, c] = numbers[r, c] * s[r // b[0], c // b[1]]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours = ct.dequantize(values, scale, b, dtype, offset)
        assert ours.dtype == dtype and torch.equal(ours, expected.to(dtype)), dtype


def test_q4_0_rows_hold_the_same_weights_and_bf16_scales_exactly():
    """A 4-bit group-32 weight becomes q4_0 without going through float: dequantised as q4_0 it is the format's
    product exactly, for bf16 scales across float16's range; below 2^-17 the scale is float16's nearest, beyond 65504
    the load says so in one line."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (6, 96), generator=gen, dtype=torch.int8)
    scale = torch.tensor([2.0 ** e for e in (-17, -10, -3, 0, 7, 15) for _ in range(3)]).reshape(6, 3)
    scale = (scale * (1 + torch.rand(6, 3, generator=gen))).bfloat16()
    rows = ct.q4_0_rows(pack(q, 4), scale, 96)
    exact = q.double() * expand(scale, q.shape, (1, 32))
    assert torch.equal(dequantize_packed(rows, "q4_0", 96, torch.float64), exact)

    tiny = torch.full((1, 1), 2.0 ** -20 * 1.3).bfloat16()
    one = torch.arange(-8, 8, dtype=torch.int8).repeat(2)[None]
    rows = ct.q4_0_rows(pack(one, 4), tiny, 32)
    assert torch.equal(dequantize_packed(rows, "q4_0", 32, torch.float64), one.double() * tiny.half().double())
    with pytest.raises(CheckpointError, match="beyond float16's 65504") as refused:
        ct.q4_0_rows(pack(one, 4), torch.full((1, 1), 1e5).bfloat16(), 32, "x", "m.weight_scale")
    assert "\n" not in str(refused.value)


# --- whole models -----------------------------------------------------------------------------------------------

def test_a_kimi_k2_int4_release_keeps_its_experts_packed_and_gives_transformers_tokens(tmp_path):
    """(a) the experts as read equal the format's product, and kept as q4_0 (auto) their blocks dequantise to it
    exactly; (b) greedy tokens equal transformers' on the dequantised copy, the experts q4_0 and dense; the size
    estimate from the headers equals the load, and the Models screen lists it."""
    from moedesk.app.tui.catalog import folder_model
    from moedesk.engine.load.size_estimate import summarize_path

    folder = build("deepseek_v3", tmp_path / "tiny", moe_intermediate_size=64)  # rows of whole groups: q4_0
    kimi, copy, exact = kimi_k2(folder, tmp_path / "kimi-k2")
    checkpoint = open_checkpoint(str(kimi))
    assert not [n for n in checkpoint.keys() if n.endswith(("_packed", "_scale", "_shape"))]
    experts = [n for n in checkpoint.keys() if routed_expert(n)]
    assert set(experts) == set(exact) and {checkpoint.packed_format(n) for n in experts} == {"q4_0"}
    for name in experts:
        assert torch.equal(checkpoint.get_tensor(name), exact[name].float()), name

    engine = Engine.load(str(kimi), device="cpu", dtype="float32")
    moe = engine.model.moe_blocks()[0]
    stack, layer = moe.experts, moe.layer
    assert (stack.gate_up_format, stack.down_format) == ("q4_0", "q4_0")
    expert = f"model.layers.{layer}.mlp.experts.5."
    gate_up = dequantize_packed(stack.gate_up[5], "q4_0", 64, torch.float64)
    assert torch.equal(gate_up[:stack.width], exact[expert + "gate_proj.weight"])
    assert torch.equal(gate_up[stack.width:], exact[expert + "up_proj.weight"])
    assert torch.equal(dequantize_packed(stack.down[5], "q4_0", 64, torch.float64), exact[expert + "down_proj.weight"])
    estimate = summarize_path(kimi).estimate("auto", "float32")
    assert estimate.experts_as == "q4_0" and estimate.expert_bytes == sum(m.experts.nbytes for m in
                                                                          engine.model.moe_blocks())
    assert folder_model(kimi, "folder").supported

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(copy), p, 16, eos) for p in prompts]
    assert greedy(engine, prompts, 16) == expected
    dense = Engine.load(str(kimi), device="cpu", dtype="float32", expert_dtype="bf16")
    assert dense.model.moe_blocks()[0].experts.describe() == "float32"
    assert greedy(dense, prompts, 16) == expected


def test_every_linear_in_int4_with_partial_groups_loads_dequantised(tiny_checkpoint, tmp_path):
    """Every projection quantised (attention's 24- and 48-wide rows end in partial groups, none q4_0): read as the
    format's product, the experts quantised to q4_0 by auto where their rows allow and dense where not, the tokens
    with dense experts transformers'."""
    quantization = ct_config(int_weights(4), "pack-quantized", ["lm_head"])
    release_, copy, exact = release(tiny_checkpoint("deepseek_v3"), tmp_path / "all", quantization, linear,
                                    ("int", 4, 32))
    checkpoint = open_checkpoint(str(release_))
    partial = [n for n in exact if "kv_b_proj" in n or "experts.0.down_proj" in n]  # 24 and 48 wide
    assert partial and not any(checkpoint.packed_format(n) for n in partial)
    for name in exact:
        assert torch.equal(checkpoint.get_tensor(name), exact[name].float()), name
    auto = Engine.load(str(release_), device="cpu", dtype="float32")
    stack = auto.model.moe_blocks()[0].experts
    assert (stack.gate_up_format, stack.down_format) == ("q4_0", "dense")  # down's rows are 48 wide
    engine = Engine.load(str(release_), device="cpu", dtype="float32", expert_dtype="bf16")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    assert greedy(engine, prompts, 16) == [hf_greedy(hf_model(copy), p, 16, eos) for p in prompts]


@pytest.mark.parametrize("bits, group, formats", [(4, 16, ("q4_0", "q4_0")), (4, None, ("q4_0", "q4_0")),
                                                   (8, 32, ("q8_0", "q8_0"))])
def test_other_integer_schemes_are_dequantised_and_auto_requantises_them(bits, group, formats, tmp_path):
    """4 bits in groups of 16 or per channel, 8 bits in groups of 32: not q4_0's bytes, so read as the format's
    product and quantised by auto to the block format of as many bits (int4: q4_0, int8: q8_0), the estimate
    agreeing; with the experts dense, transformers' tokens."""
    from moedesk.engine.load.size_estimate import summarize_path

    folder = build("deepseek_v3", tmp_path / "tiny", moe_intermediate_size=64)
    int_release, copy, exact = release(folder, tmp_path / "int", ct_config(int_weights(bits, group), "pack-quantized",
                                                                          KIMI_IGNORE), routed_expert,
                                       ("int", bits, group))
    checkpoint = open_checkpoint(str(int_release))
    assert not any(checkpoint.packed_format(n) for n in exact)
    for name in exact:
        assert torch.equal(checkpoint.get_tensor(name), exact[name].float()), name
    auto = Engine.load(str(int_release), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in auto.model.moe_blocks()]
    assert {(s.gate_up_format, s.down_format) for s in stacks} == {formats}
    assert summarize_path(int_release).estimate("auto", "float32").expert_bytes == sum(s.nbytes for s in stacks)
    engine = Engine.load(str(int_release), device="cpu", dtype="float32", expert_dtype="bf16")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[1:]]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    assert greedy(engine, prompts, 12) == [hf_greedy(hf_model(copy), p, 12, eos) for p in prompts]


def test_a_mixed_precision_config_gives_each_module_its_groups_scheme():
    """format mixed-precision, each group with its own: INT4 experts and FP8 attention; ignore before targets,
    regexes matched from the name's start, exact names whole, Linear for any module; where several match, as
    compressed-tensors orders them: an exact name, then regexes in sorted order, then Linear, whatever the groups'
    order."""
    experts = {"targets": ["re:.*mlp\\.experts\\."], "format": "pack-quantized", "weights": int_weights(4)}
    attention = {"targets": ["re:.*self_attn\\.(q|kv)_", "model.layers.0.self_attn.o_proj"],
                 "format": "float-quantized", "weights": fp8_weights("block", [128, 128]),
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                       "dynamic": True}}
    rest = {"targets": ["Linear"], "format": "float-quantized", "weights": fp8_weights("channel")}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mixed-precision",
                                      "ignore": ["lm_head", "re:.*experts\\.7\\."],
                                      "config_groups": {"c": rest, "a": experts, "b": attention}}}
    plan = ct.plan(config, "config.json")
    assert plan.scheme_of("model.layers.1.mlp.experts.3.up_proj") == ct.Scheme("int", 4, (1, 32))
    assert plan.scheme_of("model.layers.1.mlp.experts.7.up_proj") is None and plan.scheme_of("lm_head") is None
    assert plan.scheme_of("model.layers.2.self_attn.kv_b_proj") == ct.Scheme("float", 8, (128, 128))
    assert plan.scheme_of("model.layers.0.self_attn.o_proj") == ct.Scheme("float", 8, (128, 128))
    assert plan.scheme_of("model.layers.1.self_attn.o_proj") == ct.Scheme("float", 8, (1, None))  # Linear
    assert plan.scheme_of("xmodel.layers.1.mlp.experts.3.up_proj") == ct.Scheme("int", 4, (1, 32))  # .* from start
    both = {"targets": ["re:.*self_attn\\.q_a", "model.layers.0.self_attn.q_a_proj"], "format": "float-quantized",
            "weights": fp8_weights("tensor")}
    config["quantization_config"]["config_groups"]["d"] = both
    plan = ct.plan(config, "config.json")
    assert plan.scheme_of("model.layers.0.self_attn.q_a_proj") == ct.Scheme("float", 8, (None, None))  # exact name
    assert plan.scheme_of("model.layers.1.self_attn.q_a_proj") == ct.Scheme("float", 8, (128, 128))  # "(q|kv)_" < "q_a"
    assert plan.scheme_of("model.layers.1.mlp.shared_experts.up_proj") == ct.Scheme("float", 8, (1, None))
    assert ct.plan({"quantization_config": {"quant_method": "fp8"}}, "x") is None and ct.plan({}, "x") is None


GLM_FP8 = {  # GLM-4.5-FP8's scheme: fp8 weights per output channel, activations rounded per token at run time
    "channel": (fp8_weights("channel"), (1, None)),
    "block": (fp8_weights("block", [32, 40]), (32, 40)),
    "tensor": (fp8_weights("tensor"), (None, None)),
}


@pytest.mark.parametrize("strategy", list(GLM_FP8))
def test_a_glm45_fp8_release_loads_its_exact_weights_and_gives_transformers_tokens(strategy, tiny_checkpoint,
                                                                                   tmp_path):
    """(a) every fp8 weight as read equals the float64 product with its channel's, block's or tensor's scale; (b)
    with the experts dense, greedy tokens equal transformers' on the dequantised copy. The routers are left out
    by name in ignore, as the release does."""
    weights, block = GLM_FP8[strategy]
    folder = tiny_checkpoint("glm4_moe")
    routers = [f"model.layers.{i}.mlp.gate" for i in range(3)]
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    quantization = ct_config(weights, "float-quantized", ["lm_head", *routers], inputs=inputs)
    glm, copy, exact = release(folder, tmp_path / strategy, quantization, linear, ("float", block),
                               scale_shape=(1,) if strategy == "tensor" else None)
    checkpoint = open_checkpoint(str(glm))
    fp8 = [n for n in checkpoint.keys() if checkpoint.stored_fp8(n)]
    assert set(fp8) == set(exact) and any(".experts." in n for n in fp8) and any("self_attn" in n for n in fp8)
    for name in fp8:
        assert torch.equal(checkpoint.get_tensor(name), exact[name].float()), name
    engine = Engine.load(str(glm), device="cpu", dtype="float32", expert_dtype="bf16")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    assert greedy(engine, prompts, 16) == [hf_greedy(hf_model(copy), p, 16, eos) for p in prompts]


def test_auto_keeps_fp8_experts_in_int8(tmp_path):
    """As for block-FP8 releases: auto quantises fp8 experts to q8_0, a byte a weight as released, sized so by the
    estimate."""
    from moedesk.engine.load.size_estimate import summarize_path

    folder = build("glm4_moe", tmp_path / "tiny", moe_intermediate_size=64)
    glm, _, _ = release(folder, tmp_path / "glm", ct_config(fp8_weights("channel"), "float-quantized", ["lm_head"]),
                        routed_expert, ("float", (1, None)))
    engine = Engine.load(str(glm), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in engine.model.moe_blocks()]
    assert {(s.gate_up_format, s.down_format) for s in stacks} == {("q8_0", "q8_0")}
    estimate = summarize_path(glm).estimate("auto", "float32")
    assert estimate.experts_as == "q8_0" and estimate.expert_bytes == sum(s.nbytes for s in stacks)


# --- what is refused -----------------------------------------------------------------------------------------------

REFUSED_CONFIGS = {
    "asymmetric": (ct_config(int_weights(4, symmetric=False), "pack-quantized"), "asymmetric"),
    "actorder": (ct_config(int_weights(4, actorder="group"), "pack-quantized"), "actorder 'group'"),
    "static activations": (ct_config(int_weights(4), "pack-quantized", inputs={"num_bits": 8, "type": "int",
                                                                                 "dynamic": False}),
                           "static activation scales"),
    "sparse": (ct_config(int_weights(4), "pack-quantized", sparsity_config={"format": "sparse-24-bitmask"}),
               "sparse format 'sparse-24-bitmask'"),
    "unknown format": (ct_config(int_weights(4), "marlin-24"), "format 'marlin-24'"),
    "nvfp4": (ct_config({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                        "nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    "int8 naive": (ct_config(int_weights(8, None), "int-quantized"), "format 'int-quantized'"),
    "3 bits": (ct_config(int_weights(3), "pack-quantized"), "3-bit int weights"),
    "kv cache": (ct_config(int_weights(4), "pack-quantized", kv_cache_scheme={"num_bits": 8, "type": "float"}),
                 "quantised KV cache"),
    "transforms": (ct_config(int_weights(4), "pack-quantized", transform_config={"config_groups": {"u": {}}}),
                   "transforms"),
    "frozen": (ct_config(int_weights(4), "pack-quantized", quantization_status="frozen"),
               "quantization_status 'frozen'"),
    "class target": (ct_config(int_weights(4), "pack-quantized", targets=["Embedding"]), "target 'Embedding'"),
    "no groups": ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "no config_groups"),
}


@pytest.mark.parametrize("variant", list(REFUSED_CONFIGS))
def test_variants_whose_numbers_differ_are_refused_in_one_line(variant, tiny_checkpoint, tmp_path):
    """Zero points, activation-ordered groups, static activation scales, sparse formats, other formats and bit
    widths, quantised KV caches, transforms, weights not yet compressed: refused before any weight is read, by the
    load and the Models screen alike, in one line naming what."""
    from moedesk.app.tui.catalog import folder_model

    quantization, named = REFUSED_CONFIGS[variant]
    folder = tmp_path / variant.replace(" ", "-")
    shutil.copytree(tiny_checkpoint("deepseek_v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(UnsupportedModelError, match="compressed-tensors") as refused:
        Engine.load(str(folder), device="cpu", dtype="float32")
    assert named in str(refused.value) and "\n" not in str(refused.value)
    listed = folder_model(folder, "folder")
    assert not listed.supported or listed.estimate_error


def test_tensors_that_disagree_with_the_config_are_refused_in_one_line(tmp_path):
    """A zero point in the file, a quantised module the config ignores, a scale of the wrong shape, a weight_shape
    that disagrees with its words: one line each, naming the tensor."""
    folder = build("deepseek_v3", tmp_path / "tiny", moe_intermediate_size=64)
    kimi, _, _ = kimi_k2(folder, tmp_path / "kimi")
    tensors = load_file(kimi / "model.safetensors")
    expert = "model.layers.1.mlp.experts.0.gate_proj."
    cases = {
        "zero point": ({**tensors, expert + "weight_zero_point": torch.zeros(64, 2, dtype=torch.int32)}, None,
                       "zero points"),
        "ignored": (tensors, KIMI_IGNORE + ["re:.*experts\\.0\\."], "mlp.experts.0.down_proj no scheme"),
        "scale shape": ({**tensors, expert + "weight_scale": tensors[expert + "weight_scale"][:, :1].contiguous()}, None,
                        "weight_scale has shape [64, 1]"),
        "weight shape": ({**tensors, expert + "weight_shape": torch.tensor([64, 56], dtype=torch.int32)}, None,
                         "weight_shape says [64, 56]"),
    }
    for case, (written, ignore, named) in cases.items():
        bad = tmp_path / case.replace(" ", "-")
        shutil.copytree(kimi, bad)
        save_file(written, str(bad / "model.safetensors"), metadata={"format": "pt"})
        if ignore is not None:
            config = json.loads((bad / "config.json").read_text())
            config["quantization_config"]["ignore"] = ignore
            (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises((CheckpointError, UnsupportedModelError)) as refused:
            Engine.load(str(bad), device="cpu", dtype="float32")
        assert named in str(refused.value) and "\n" not in str(refused.value), (case, str(refused.value))


@pytest.mark.gpu
def test_compressed_tensors_releases_on_cuda(tmp_path):
    """On the GPU in bfloat16: Kimi-K2's INT4 experts as q4_0 (read on the CPU, copied packed) and GLM's per-channel
    FP8 weights dequantised on the GPU as they load; tokens as transformers' bf16 on the dequantised copy, or a tie
    (tests/model/test_gpu_equivalence.py's check)."""
    from tests.model.test_gpu_equivalence import check_greedy

    deepseek = build("deepseek_v3", tmp_path / "deepseek", moe_intermediate_size=64)
    kimi, kimi_copy, _ = kimi_k2(deepseek, tmp_path / "kimi")
    glm4 = build("glm4_moe", tmp_path / "glm4", moe_intermediate_size=64)
    glm, glm_copy, _ = release(glm4, tmp_path / "glm", ct_config(fp8_weights("channel"), "float-quantized",
                                                                  ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                                                 for i in range(3)]),
                               linear, ("float", (1, None)))
    for folder, copy, formats in ((kimi, kimi_copy, {"q4_0"}), (glm, glm_copy, {"q8_0"})):
        engine = Engine.load(str(folder), device="cuda", dtype="bfloat16")
        assert {moe.experts.describe() for moe in engine.model.moe_blocks()} == formats
        check_greedy(engine, hf_model(copy, torch.bfloat16, "cuda"), [engine.tokenizer.encode(p) for p in PROMPTS],
                     ref32=hf_model(copy, torch.float32, "cuda"))
