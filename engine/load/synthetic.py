"""Random-weight models of real MoE shapes, built in memory without a file, for benchmarks.

Speed does not depend on the values, so expert weights tile one random block (as the
llama.cpp comparison's GGUF does), in 16 bits or packed and are written straight into the stacked host banks the
offload executor uses; no full-size copy of the model ever exists twice.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from moedesk.engine.model.config import ModelConfig, RopeConfig
from moedesk.engine.model.transformer import Rotary, Transformer
from moedesk.kernels.expert_weights import DENSE, ExpertWeights
from moedesk.kernels.quant_formats import QUANTIZE_TO, packed_format, quantize

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
        cfg = replace(cfg, num_layers=layers, moe_layers=cfg.moe_layers[:layers])
    return cfg


def _tile(out: torch.Tensor, block: torch.Tensor) -> None:
    flat = out.view(-1)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])


def synthetic_model(cfg: ModelConfig, dtype: torch.dtype, device, pinned: bool, context: int = 4096, seed: int = 0,
                    expert_format: str = DENSE):
    """(model, banks): non-expert weights random on `device`; banks[layer] an ExpertWeights stack on the host,
    in `dtype` or, with expert_format, packed (kernels.quant_formats): a random block of weights quantised
    to that format and tiled, so the packed bytes are realistic (sane scales) without quantising the whole
    model (k-quants, which moedesk does not quantise itself, tile random blocks with small scales)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg, context)
    for name, param in list(model.named_parameters()):
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=dtype)
        else:
            # Router weights stay well-scaled random so that routing is spread like a trained model's.
            std = 1.0 if name.endswith("router.weight") else 0.02
            value = (torch.randn(param.shape, generator=gen) * std).to(dtype)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value.to(device), requires_grad=False))
    model.rotary = Rotary(cfg, context).to(device)
    model.fuse_projections()
    E, F_, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    banks = {}
    for moe in model.moe_blocks():
        w = ExpertWeights.empty(E, H, F_, dtype=dtype, gate_up_format=expert_format, down_format=expert_format,
                                pin_memory=pinned)
        for stack, k in ((w.gate_up, H), (w.down, F_)):
            _tile(stack, _random_block(expert_format, k, dtype, gen))
        moe.experts = banks[moe.layer] = w
    return model.eval(), banks


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
    scale = torch.full((raw.shape[0], 1), 0.001, dtype=torch.float16).view(torch.uint8)
    for at in _SCALE_BYTES[fmt]:
        raw[:, at:at + 2] = scale
    return raw.view(-1)


_SCALE_BYTES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # where each k-quant block keeps its float16 scales


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
