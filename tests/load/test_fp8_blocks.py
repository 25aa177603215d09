"""Checkpoints released in block-scaled FP8 (engine/load/fp8_blocks.py), written here as the releases lay them out:
transformers' tiny random Qwen3-MoE and DeepSeek-V3 with every linear weight but the router's (and the embeddings')
rounded to float8_e4m3fn per block, beside its float32 `weight_scale_inv`, and the config's quantization_config. The
reference is transformers on a float32 copy of the same weights, dequantised here by broadcasting each block's scale
(not moedesk's code): its greedy tokens are ours, and ours are the weights' exact values."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.load.fp8_blocks import dequantize_blocks
from moedesk.engine.runtime import Engine
from tests.model.test_families import greedy, teacher_forced
from tests.reference import hf_greedy, hf_model
from tests.tiny_models import build

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
E4M3_MAX = 448.0
# Blocks that are not square and divide none of the tiny models' sizes (64, 48, 384...): every matrix ends in
# partial blocks along both dimensions.
BLOCK = (32, 40)


def quantised(name: str, t: torch.Tensor) -> bool:
    """What the releases quantise: linear weights, not the embeddings, lm_head, norms or the router."""
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))


def broadcast(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each block's scale repeated over its block, cut to the weight's shape: the reference dequantisation."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def to_fp8(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weights, float32 scales [ceil(rows/B0), ceil(cols/B1)]): each block's largest magnitude at 448."""
    rows, cols = w.shape
    padded = torch.zeros(math.ceil(rows / block[0]) * block[0], math.ceil(cols / block[1]) * block[1])
    padded[:rows, :cols] = w
    amax = padded.reshape(padded.shape[0] // block[0], block[0], -1, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (w.float() / broadcast(scale, w.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_release(folder, out, block=BLOCK, **quantization):
    """`folder`'s checkpoint as an FP8 release in `out`; returns (out, its float32 dequantised copy's folder)."""
    shutil.copytree(folder, out)
    copy = out.with_name(out.name + "-dequantised")
    shutil.copytree(folder, copy)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), **quantization}
    (out / "config.json").write_text(json.dumps(config))
    tensors, exact = load_file(folder / "model.safetensors"), {}
    for name in [n for n, t in tensors.items() if quantised(n, t)]:
        q, scale = to_fp8(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        exact[name] = q.float() * broadcast(scale, q.shape, block)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({n: exact.get(n, t.float()) for n, t in tensors.items() if not n.endswith("_scale_inv")},
              str(copy / "model.safetensors"), metadata={"format": "pt"})
    return out, copy


# --- the rule --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, block", [((130, 257), (128, 128)), ((5, 3), (2, 2)), ((3, 64, 48), (32, 40)),
                                          ((1, 1), (128, 128))])
def test_each_value_is_multiplied_by_its_blocks_scale(shape, block):
    """Partial blocks at the ends, non-square blocks, a stack of experts: value by value, the fp8 number (as float32)
    times its block's scale, to the bit."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    *lead, rows, cols = shape
    scale = torch.rand((*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1])), generator=gen) + 1e-3
    ours = dequantize_blocks(weight, scale, block)
    flat_w, flat_s = weight.reshape(-1, rows, cols).float(), scale.reshape(-1, *scale.shape[-2:])
    expected = torch.empty(flat_w.shape)
    for s in range(flat_w.shape[0]):
        for r in range(rows):
            for c in range(cols):
                expected[s, r, c] = flat_w[s, r, c] * flat_s[s, r // block[0], c // block[1]]
    assert ours.dtype == torch.float32 and torch.equal(ours, expected.reshape(shape))
    for dtype in (torch.bfloat16, torch.float16):  # what a 16-bit model loads: the float32 product, rounded once
        assert torch.equal(dequantize_blocks(weight, scale, block, dtype), expected.reshape(shape).to(dtype))


def test_exponent_scales_are_powers_of_two():
    """ue8m0 scales stored as bytes (DeepSeek's later releases): 2 ** (byte - 127)."""
    weight = torch.tensor([[1.5, -2.0, 0.25]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 130]], dtype=torch.uint8)
    assert dequantize_blocks(weight, scale, (1, 2)).tolist() == [[1.5, -2.0, 0.25 * 8]]
    as_e8m0 = scale.view(torch.float8_e8m0fnu)  # safetensors' F8_E8M0
    assert dequantize_blocks(weight, as_e8m0, (1, 2)).tolist() == [[1.5, -2.0, 0.25 * 8]]


# --- whole models ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_release_loads_its_exact_weights_and_gives_transformers_tokens(arch, tiny_checkpoint, tmp_path):
    """(a) every quantised weight as moedesk reads it, and the experts as loaded, equal weight.float() * the block's
    scale; (b) with the experts kept dense, greedy tokens equal transformers' on the dequantised float32 copy."""
    release, copy = fp8_release(tiny_checkpoint(arch), tmp_path / arch)
    exact = load_file(copy / "model.safetensors")
    checkpoint = open_checkpoint(str(release))
    assert not [n for n in checkpoint.keys() if n.endswith("_scale_inv")]
    fp8 = [n for n in checkpoint.keys() if checkpoint.stored_fp8(n)]
    assert any(".experts." in n for n in fp8) and any("self_attn" in n for n in fp8)
    assert not any(n.endswith("mlp.gate.weight") or "embed" in n for n in fp8)  # left as released: 32-bit
    for name in fp8:
        assert torch.equal(checkpoint.get_tensor(name), exact[name]), name

    engine = Engine.load(str(release), device="cpu", dtype="float32", expert_dtype="bf16")
    moe = engine.model.moe_blocks()[0]
    stack, layer = moe.experts, moe.layer
    assert stack.describe() == "float32"
    expert = f"model.layers.{layer}.mlp.experts.3."
    assert torch.equal(stack.gate_up[3, :stack.width], exact[expert + "gate_proj.weight"])
    assert torch.equal(stack.gate_up[3, stack.width:], exact[expert + "up_proj.weight"])
    assert torch.equal(stack.down[3], exact[expert + "down_proj.weight"])

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(copy), p, 16, eos) for p in prompts]
    assert greedy(engine, prompts, 16) == expected


def test_auto_keeps_fp8_experts_in_int8_sized_as_estimated_and_close_to_exact(tmp_path):
    """--expert-dtype auto quantises an FP8 release's experts to q8_0 (a byte a weight, as downloaded), which the
    estimate from the headers alone sizes to the byte; the logits stay close to the exact model's on transformers'
    own greedy sequences, and q8_0 adds less error to the weights than the FP8 rounding had."""
    from moedesk.engine.load.size_estimate import summarize_path
    from moedesk.kernels.quant_formats import dequantize, quantize

    folder = build("qwen3_moe", tmp_path / "tiny", moe_intermediate_size=64)  # q8_0 wants rows of 32s: 64, not 48
    release, copy = fp8_release(folder, tmp_path / "qwen3_moe")
    exact = Engine.load(str(release), device="cpu", dtype="float32", expert_dtype="bf16")
    auto = Engine.load(str(release), device="cpu", dtype="float32")
    stacks = [moe.experts for moe in auto.model.moe_blocks()]
    assert {(s.gate_up_format, s.down_format) for s in stacks} == {("q8_0", "q8_0")}
    estimate = summarize_path(release).estimate("auto", "float32")
    assert estimate.experts_as == "q8_0" and estimate.expert_bytes == sum(s.nbytes for s in stacks)
    assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in auto.model.parameters())
    from moedesk.app.tui.catalog import folder_model

    listed = folder_model(release, "folder")  # the Models screen: supported, sized as loaded
    assert listed.supported and listed.weights.estimate("auto", "float32") == estimate, listed.estimate_error

    errors, agreement = [], []
    eos = auto.tokenizer.eos_token_ids | set(auto.config.eos_token_ids)
    for prompt in [auto.tokenizer.encode(p) for p in PROMPTS]:
        ids = prompt + hf_greedy(hf_model(copy), prompt, 16, eos)
        theirs, ours = teacher_forced(exact, ids), teacher_forced(auto, ids)
        errors.append(float((ours - theirs).abs().mean() / theirs.std()))
        agreement += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
    print(f"fp8 experts as q8_0: mean logit error {max(errors):.4f} of their spread, top-1 {np.mean(agreement):.3f}")
    assert max(errors) <= 0.05 and np.mean(agreement) >= 0.9, (errors, np.mean(agreement))

    original = load_file(folder / "model.safetensors")["model.layers.0.mlp.experts.0.down_proj.weight"]
    dequantised = load_file(copy / "model.safetensors")["model.layers.0.mlp.experts.0.down_proj.weight"]
    requantised = dequantize(quantize(dequantised, "q8_0"), "q8_0", dequantised.shape[1])
    fp8_error, q8_error = (dequantised - original).norm(), (requantised - dequantised).norm()
    print(f"relative error: fp8 {fp8_error / original.norm():.4f}, q8_0 on top {q8_error / original.norm():.4f}")
    assert q8_error < fp8_error


def test_kimi_k2_and_minimax_spellings_of_the_config_load(tiny_checkpoint, tmp_path):
    """The releases' other spellings of the same format: fmt float8_e4m3fn (MiniMax-M2), scale_fmt ue8m0 with float
    scales (DeepSeek-V3.1), the skip-list under modules_to_not_convert or ignored_layers."""
    release, _ = fp8_release(tiny_checkpoint("qwen3_moe"), tmp_path / "spelt", fmt="float8_e4m3fn",
                             scale_fmt="ue8m0", ignored_layers=["lm_head"], modules_to_not_convert=["gate"])
    engine = Engine.load(str(release), device="cpu", dtype="float32", expert_dtype="bf16")
    assert engine.model.moe_blocks()[0].experts.describe() == "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("arch, expert_dtype", [("qwen3_moe", "auto"), ("deepseek_v3", "bf16")])
def test_an_fp8_release_on_cuda(arch, expert_dtype, tiny_checkpoint, tmp_path):
    """On the GPU in bfloat16: the release's tokens as transformers' bf16 on the dequantised copy, or a tie, and no
    further from its float32 logits than transformers' bf16 is (tests/model/test_gpu_equivalence.py's check); auto's
    experts in q8_0, quantised on the GPU as they load."""
    from tests.model.test_gpu_equivalence import check_greedy

    build_args = {"moe_intermediate_size": 64} if expert_dtype == "auto" else {}  # q8_0 rows of 32s
    folder = build(arch, tmp_path / "tiny", **build_args) if build_args else tiny_checkpoint(arch)
    release, copy = fp8_release(folder, tmp_path / arch)
    engine = Engine.load(str(release), device="cuda", dtype="bfloat16", expert_dtype=expert_dtype)
    formats = {moe.experts.describe() for moe in engine.model.moe_blocks()}
    assert formats == ({"q8_0"} if expert_dtype == "auto" else {"bfloat16"}), formats
    check_greedy(engine, hf_model(copy, torch.bfloat16, "cuda"), [engine.tokenizer.encode(p) for p in PROMPTS],
                 ref32=hf_model(copy, torch.float32, "cuda"))
