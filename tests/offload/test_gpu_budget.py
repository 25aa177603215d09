"""The GPU budget's split between weights, the KV cache of a context, attention's workspace and experts."""
import pytest
import torch

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.transformer import Transformer
from moedesk.engine.offload.gpu_budget import (
    GIB, ContextBudgetError, kv_bytes_per_position, longest_context, non_expert_bytes, prefill_workspace_bytes,
    split_gpu_budget)
from moedesk.engine.generation.scheduler import PREFILL_CHUNK_GPU as PREFILL_PIECE_GPU
from moedesk.kernels.quant_formats import FORMATS


def split_for(shape: str, budget_gib: float, context: int, rows: int = 1):
    cfg = shape_config(shape)
    return cfg, split_gpu_budget(int(budget_gib * GIB), non_expert_bytes(cfg, 2), kv_bytes_per_position(cfg, 2),
                                 context, prefill_workspace_bytes(cfg, PREFILL_PIECE_GPU, context, 2), rows)


def q4_k_expert_bytes(cfg) -> int:
    return int(3 * cfg.hidden_size * cfg.moe_intermediate_size * FORMATS["q4_k"].bits_per_weight() / 8)


@pytest.mark.parametrize("shape, kv_gib, least_experts", [("mixtral-8x7b", 4.0, 64), ("qwen3-30b-a3b", 3.0, 3000)])
def test_a_32k_context_fits_a_16_gib_budget_beside_resident_experts(shape, kv_gib, least_experts):
    """Mixtral: 2.99 GiB of weights, 4 GiB of cache, 1.1 GiB of workspace, 0.8 of slack, 7.1 GiB (77 Q4_K experts
    of 256) left; Qwen3: 2.87 + 3 + 0.81 + 0.8, 8.5 GiB (3447 of 6144). Every byte is accounted for once."""
    cfg, split = split_for(shape, 16, 32768)
    assert split.kv_cache == kv_gib * GIB
    assert split.weights + split.kv_cache + split.workspace + split.slack + split.experts == 16 * GIB
    assert split.experts_fit(q4_k_expert_bytes(cfg)) >= least_experts
    # Flash-style attention: no [heads, piece, context] score matrix, which alone would take 8 GiB in float32.
    scores = cfg.num_heads * PREFILL_PIECE_GPU * 32768 * 4
    assert split.workspace < scores / 4


def test_a_longer_context_takes_its_cache_from_the_experts_only():
    cfg, short = split_for("mixtral-8x7b", 16, 8192)
    _, long = split_for("mixtral-8x7b", 16, 32768)
    assert long.weights == short.weights
    assert long.kv_cache - short.kv_cache == (32768 - 8192) * kv_bytes_per_position(cfg, 2)
    assert short.experts - long.experts == (long.kv_cache - short.kv_cache) + (long.workspace - short.workspace)


def test_a_budget_too_small_for_the_context_names_one_that_fits():
    cfg = shape_config("mixtral-8x7b")
    weights, per = non_expert_bytes(cfg, 2), kv_bytes_per_position(cfg, 2)
    workspace = prefill_workspace_bytes(cfg, PREFILL_PIECE_GPU, 32768, 2)
    with pytest.raises(ContextBudgetError) as refused:
        split_gpu_budget(8 * GIB, weights, per, 32768, workspace)
    message = str(refused.value)
    assert "\n" not in message and "--gpu-budget" in message
    fits = int(message.split("at most ")[1].split()[0])
    assert fits == longest_context(8 * GIB, weights, per, workspace)
    assert split_gpu_budget(8 * GIB, weights, per, fits, workspace).experts >= 0
    with pytest.raises(ContextBudgetError):
        split_gpu_budget(8 * GIB, weights, per, fits + 1, workspace)


def test_several_rows_each_hold_a_whole_context():
    cfg, one = split_for("qwen3-30b-a3b", 24, 16384)
    _, four = split_for("qwen3-30b-a3b", 24, 16384, rows=4)
    assert four.kv_cache == 4 * one.kv_cache and four.experts == one.experts - 3 * one.kv_cache


def test_the_sizes_are_those_of_the_model_and_cache_the_engine_builds():
    """The formulas against the real modules of a tiny shape: its non-expert parameters and its KV cache."""
    cfg = shape_config("tiny-moe")
    model = Transformer(cfg, 64)
    other = sum(p.numel() for name, p in model.named_parameters() if ".experts." not in name and "norm" not in name)
    assert non_expert_bytes(cfg, 2) == 2 * other
    cache = model.new_cache(1, 64, torch.bfloat16, "cpu")
    assert kv_bytes_per_position(cfg, 2) == cache.bytes_per_position()
    assert cache.nbytes() == 64 * kv_bytes_per_position(cfg, 2)


def test_latent_attention_budgets_its_latent_cache():
    """DeepSeek-V3 caches kv_lora_rank + rope dims a token and layer (engine.model.mla), not every head's keys and
    values: the budget counts what the model's cache holds, at a size the CPU builds."""
    import dataclasses

    v3 = shape_config("deepseek-v3")
    assert kv_bytes_per_position(v3, 2) == v3.num_layers * (512 + 64) * 2
    small = dataclasses.replace(v3, num_layers=2, moe_layers=v3.moe_layers[:2], hidden_size=64, vocab_size=64,
                                num_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    cache = Transformer(small, 16).new_cache(1, 16, torch.bfloat16, "cpu")
    assert kv_bytes_per_position(small, 2) == cache.bytes_per_position() and cache.nbytes() == 16 * 2 * 2 * 576


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError):
        split_gpu_budget(GIB, -1, 10, 10, 0)
