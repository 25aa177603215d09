"""Random-weight models of real MoE shapes, built in memory without a file, for benchmarks.

Speed does not depend on the values, so expert weights tile one random block (as the
llama.cpp comparison's GGUF does) and are written straight into the stacked host banks the
offload executor uses; no full-size copy of the model ever exists twice.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig, RopeConfig
from engine.model import Rotary, Transformer

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
}


def shape_config(name: str, layers: int | None = None) -> ModelConfig:
    from dataclasses import replace

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


def synthetic_model(cfg: ModelConfig, dtype: torch.dtype, device, pinned: bool, context: int = 4096, seed: int = 0):
    """(model, banks): non-expert weights random on `device`; banks[layer] = (gate_up [E,2F,H], down [E,H,F]) on the host."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg, context)
    for name, param in list(model.named_parameters()):
        if ".experts." in name:
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=dtype)
        else:
            # Router weights stay well-scaled random so that routing is spread like a trained model's.
            std = 1.0 if name.endswith("router.weight") else 0.02
            value = (torch.randn(param.shape, generator=gen) * std).to(dtype)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value.to(device), requires_grad=False))
    model.rotary = Rotary(cfg, context).to(device)
    block = (torch.randn(1 << 24, generator=gen) * 0.02).to(dtype)
    E, F_, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    banks = {}
    for moe in model.moe_blocks():
        gate_up = torch.empty((E, 2 * F_, H), dtype=dtype, pin_memory=pinned)
        down = torch.empty((E, H, F_), dtype=dtype, pin_memory=pinned)
        _tile(gate_up, block)
        _tile(down, block)
        banks[moe.layer] = (gate_up, down)
    return model.eval(), banks

# A shape small enough for CI to run the benchmark code path on the CPU.
SHAPES["tiny-moe"] = ModelConfig(
    arch="mixtral", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, norm_topk_prob=True, moe_layers=(True,) * 4, eos_token_ids=(2,))
