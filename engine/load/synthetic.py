"""Random-weight models of real MoE shapes, built in memory without a file, for benchmarks.

Speed does not depend on the values, so expert weights tile one random block (as the
llama.cpp comparison's GGUF does), in 16 bits or packed and are written straight into the stacked host banks the
offload executor uses; no full-size copy of the model ever exists twice.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from moedesk.engine.model.config import ModelConfig, RopeConfig
from moedesk.engine.model.embedding import keep_in_host, table_in_host
from moedesk.engine.model.transformer import Transformer
from moedesk.kernels.expert_weights import DENSE, ExpertWeights
from moedesk.kernels.quant_formats import QUANTIZE_TO, format_for_rows, packed_format, quantize

SHAPES = {
    "mixtral-8x7b": ModelConfig(
        arch="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, max_position_embeddings=32768,
        rope=RopeConfig(theta=1e6), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
        norm_topk_prob=True, moe_layers=(True,) * 32, eos_token_ids=(2,)),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, intermediate_size=6144, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope=RopeConfig(theta=1e6), qk_norm="head", num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, moe_layers=(True,) * 48, eos_token_ids=(151645,)),
    # zai-org/GLM-4.5-Air's config.json: the first layer dense, then 128 experts top-8 and one shared expert,
    # sigmoid routing, half of each head turned by RoPE, q/k/v biases.
    "glm-4.5-air": ModelConfig(
        arch="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
        head_dim=128, intermediate_size=10944, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope=RopeConfig(theta=1e6), attention_bias=True, rotary_dim=64, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1408, norm_topk_prob=True, shared_expert_intermediate_size=1408,
        shared_expert_gate=False, router="sigmoid", moe_layers=(False,) + (True,) * 45,
        eos_token_ids=(151329, 151336, 151338), mtp_layers=1),
}


def shape_config(name: str, layers: int | None = None) -> ModelConfig:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    cfg = SHAPES[name]
    if layers:
        cfg = replace(cfg, num_layers=layers, moe_layers=cfg.moe_layers[:layers],
                      linear_layers=cfg.linear_layers[:layers])
    return cfg


def _tile(out: torch.Tensor, block: torch.Tensor) -> None:
    flat = out.view(-1)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])


def synthetic_model(cfg: ModelConfig, dtype: torch.dtype, device, pinned: bool, context: int = 4096, seed: int = 0,
                    expert_format: str = DENSE, packed_weights: bool | None = None):
    """(model, banks): non-expert weights random on `device`; banks[layer] an ExpertWeights stack on the host,
    in `dtype` or, with expert_format, packed (kernels.quant_formats): a random block of weights quantised
    to that format and tiled, so the packed bytes are realistic (sane scales) without quantising the whole
    model (k-quants, which moedesk does not quantise itself, tile random blocks with small scales).
    packed_weights (default: as a load onto `device` would, packed_linear.wanted) with a packed expert_format: the
    non-expert weights a GGUF of that quantisation keeps packed are packed likewise (`packed_plan`), as
    PackedLinears."""
    from moedesk.engine.model.packed_linear import replace_linear

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg, context)
    plan = packed_plan(cfg, expert_format, packed_weights, model, device)
    blocks = {}  # (format, k) -> a random block, tiled into every weight of that shape of row
    for name, param in list(model.named_parameters()):
        if name in plan:
            fmt, rows, k = plan[name]
            if (fmt, k) not in blocks:
                blocks[fmt, k] = _random_block(fmt, k, dtype, gen)
            packed = torch.empty(rows, packed_format(fmt).row_bytes(k), dtype=torch.uint8)
            _tile(packed, blocks[fmt, k])
            replace_linear(model, name, packed.to(device), fmt, k, dtype)
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=dtype)
        else:
            # Router weights stay well-scaled random so that routing is spread like a trained model's.
            std = 1.0 if name.endswith("router.weight") else 0.02
            value = (torch.randn(param.shape, generator=gen) * std).to(dtype)
        if name == "embed.weight" and pinned and table_in_host(cfg, device):  # as a load with host banks keeps it
            keep_in_host(model.embed, value.pin_memory(), device)  # torch's pinned memory, as the banks below
            continue
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value.to(device), requires_grad=False))
    model.rotary.to(device)  # its tables are real already (Rotary)
    model.fuse_projections()
    E, F_, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    banks = {}
    for moe in model.moe_blocks():
        gate_up_format, down_format = expert_formats(expert_format, H, F_)
        w = ExpertWeights.empty(E, H, F_, dtype=dtype, gate_up_format=gate_up_format, down_format=down_format,
                                pin_memory=pinned)
        for stack, fmt, k in ((w.gate_up, gate_up_format, H), (w.down, down_format, F_)):
            _tile(stack, _random_block(fmt, k, dtype, gen))
        moe.experts = banks[moe.layer] = moe.join_expert_function(w)  # gpt-oss's biases and activation
    return model.eval(), banks


# llama.cpp's MXFP4_MOE files (gpt-oss) hold only the experts in MXFP4, every other tensor in Q8_0
# (its llama-quant.cpp); the other types of a file pack the rest in the experts' format or its fallback.
NON_EXPERT_FORMAT = {"mxfp4": "q8_0"}


def packed_plan(cfg: ModelConfig, expert_format: str, packed_weights: bool | None = None,
                model: Transformer | None = None, device="cuda") -> dict[str, tuple[str, int, int]]:
    """The non-expert weights synthetic_model packs: our name -> (format, rows, columns), every Linear weight a GGUF
    keeps packed (engine.model.packed_linear.packable) in the format a GGUF of expert_format gives them
    (NON_EXPERT_FORMAT, else expert_format) or its fallback for its rows (format_for_rows); {} unless packed_weights
    (default: packed_linear.wanted(device)) and expert_format is packed."""
    from moedesk.engine.model import packed_linear

    wanted = packed_linear.wanted(device) if packed_weights is None else packed_weights
    if not wanted or expert_format == DENSE:
        return {}
    if model is None:
        with torch.device("meta"):
            model = Transformer(cfg, 1)
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and packed_linear.packable(f"{name}.weight") \
                and not (name == "lm_head" and cfg.tie_word_embeddings):
            fmt = format_for_rows(NON_EXPERT_FORMAT.get(expert_format, expert_format), module.in_features)
            if fmt in packed_linear.formats():
                plan[f"{name}.weight"] = (fmt, module.out_features, module.in_features)
    return plan


def expert_formats(expert_format: str, hidden: int, width: int) -> tuple[str, str]:
    """(gate_up, down) formats for `expert_format`: each projection falls back on its own where the format's blocks
    do not tile its rows (hidden weights for gate/up, width for down), as llama.cpp's quantiser does
    (kernels.quant_formats.format_for_rows)."""
    if expert_format == DENSE:
        return DENSE, DENSE
    return tuple(format_for_rows(expert_format, k) or DENSE for k in (hidden, width))


def format_fallbacks(expert_format: str, hidden: int, width: int) -> list[str]:
    """One line for each projection that `expert_formats` stores in another format than the one asked for."""
    lines = []
    for proj, k, fmt in zip(("gate/up", "down"), (hidden, width), expert_formats(expert_format, hidden, width)):
        if fmt != expert_format:
            block = packed_format(expert_format).block
            lines.append(f"{proj} projection: rows of {k} weights are not whole {expert_format} blocks of {block}, "
                         f"stored as {fmt} (llama.cpp's quantiser falls back per tensor likewise)")
    return lines


def _random_block(fmt: str, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """About 16 MiB of random rows of k weights, in `dtype` or packed as `fmt`, flattened."""
    if fmt == DENSE:
        return (torch.randn(1 << 24, generator=gen) * 0.02).to(dtype)
    rows = max(1, (1 << 24) // k)
    weights = torch.randn(rows, k, generator=gen) * 0.02
    if fmt in QUANTIZE_TO.values():
        return quantize(weights, fmt).view(-1)
    f = packed_format(fmt)
    raw = torch.randint(0, 256, (rows * k // f.block, f.block_bytes), generator=gen, dtype=torch.uint8)
    if fmt == "mxfp4":
        raw[:, 0] = 120  # every block's exponent: weights up to 6 * 2^-7
    scale = torch.full((raw.shape[0], 1), 0.001, dtype=torch.float16).view(torch.uint8)
    for at in _SCALE_BYTES[fmt]:
        raw[:, at:at + 2] = scale
    return raw.view(-1)


_SCALE_BYTES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "mxfp4": ()}  # where each block keeps float16 scales


def _from_hub_config(config: dict) -> ModelConfig:
    """What the loader makes of a model's config.json (so a shape cannot drift from what a real load runs)."""
    from moedesk.engine.model.architectures import parse_config

    return parse_config(config, "config.json", tensors={})


_YARN = {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
# openai/gpt-oss-120b's config.json: sliding (128) and full layers alternating, 128 experts top-4, MXFP4 experts on
# the Hub (--expert-format mxfp4).
_GPT_OSS_120B = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "swiglu_limit": 7.0, "eos_token_id": 200002, "attention_bias": True,
    "rope_scaling": {**_YARN, "factor": 32.0, "truncate": False}, "rope_theta": 150000.0,
    "layer_types": ["sliding_attention", "full_attention"] * 18}
SHAPES["gpt-oss-120b"] = _from_hub_config(_GPT_OSS_120B)
# openai/gpt-oss-20b's config.json: the 120b's layer with 32 experts, 24 layers; its MXFP4 file fits a 16 GB GPU
# whole.
SHAPES["gpt-oss-20b"] = _from_hub_config({**_GPT_OSS_120B, "num_hidden_layers": 24, "num_local_experts": 32,
                                          "layer_types": ["sliding_attention", "full_attention"] * 12})
# deepseek-ai/DeepSeek-V3's config.json: MLA, 256 experts top-8 in 8 groups (4 kept), 3 dense first layers.
SHAPES["deepseek-v3"] = _from_hub_config({
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 1, "rope_theta": 10000.0,
    "rope_scaling": {**_YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}})
# Qwen/Qwen3.5-35B-A3B's text_config: 40 layers, three Gated DeltaNet layers (16 key heads, 32 value heads of 128)
# to each gated full-attention layer (16 heads of 256, 2 key/value heads, a quarter of each rotated), 256 experts
# top-8 of width 512 and a gated shared expert of 512.
SHAPES["qwen3.5-35b-a3b"] = _from_hub_config({
    "model_type": "qwen3_5_moe", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}})
# MiniMaxAI/MiniMax-M2's config.json: 62 layers of 48 heads (8 key/value heads of 128, half of each rotated, q/k
# norms over all heads), 256 experts top-8 of width 1536, sigmoid routing with a correction bias.
SHAPES["minimax-m2"] = _from_hub_config({
    "model_type": "minimax_m2", "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536,
    "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 256, "num_experts_per_tok": 8, "rotary_dim": 64, "rope_theta": 5e6, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 196608, "eos_token_id": 200020, "scoring_func": "sigmoid", "use_qk_norm": True})

# A shape small enough for CI to run the benchmark code path on the CPU.
SHAPES["tiny-moe"] = ModelConfig(
    arch="mixtral", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, norm_topk_prob=True, moe_layers=(True,) * 4, eos_token_ids=(2,))
# GLM-4.5-Air's switches at that size: the benchmark's path through a dense first layer and sigmoid routing.
SHAPES["tiny-glm"] = replace(SHAPES["glm-4.5-air"], vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                             num_kv_heads=2, head_dim=16, rotary_dim=8, intermediate_size=128,
                             max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             moe_layers=(False,) + (True,) * 3, eos_token_ids=(2,))
# Qwen3.5's switches at that size: Gated DeltaNet layers beside a gated full-attention layer, a gated shared expert.
SHAPES["tiny-qwen35"] = replace(SHAPES["qwen3.5-35b-a3b"], vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                                num_kv_heads=2, head_dim=16, rotary_dim=4, max_position_embeddings=4096,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=64, moe_layers=(True,) * 4,
                                linear_layers=(True, True, True, False), linear_key_heads=2, linear_value_heads=4,
                                linear_key_dim=16, linear_value_dim=16)
