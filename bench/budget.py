"""What `--gpu-budget` means in `moedesk bench`: the whole GPU, split as Engine splits a loaded model's.

A user's named budget holds the non-expert weights, one sequence's KV cache at the whole context, a prefill
piece's workspace and slack before any expert (engine.offload.gpu_budget.model_split). The bench splits its own
budget the same way at the context it builds its model for, so its figures at "16 GiB" are a user's at 16 GiB.

The sizes come from the synthetic model as it would be built, made on the meta device: its parameters in the
bench's dtype, its buffers (rotary tables) as they are, its cache's cost per position and per row. Nothing is
allocated, so a budget too small is refused before a model of tens of GB is built, and scripts can ask which
budget holds a given number of experts.
"""
from __future__ import annotations

import torch

from moedesk.engine.model.config import ModelConfig
from moedesk.engine.offload.gpu_budget import BudgetSplit, budget_holding, model_split

GIB = 2**30


def bench_dtype(device) -> torch.dtype:
    """The dtype `moedesk bench` builds in: bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def bench_split(cfg: ModelConfig, budget: int, context: int, dtype: torch.dtype, prefill_piece: int,
                expert_format: str = "dense", device="cuda") -> BudgetSplit:
    """The split of `budget` bytes for the bench's model of `cfg` built on `device` for `context` positions
    (ContextBudgetError, one line naming a context that fits, when its weights and cache alone do not fit)."""
    from moedesk.engine.load.synthetic import packed_plan
    from moedesk.engine.memory_fit import packed_savings
    from moedesk.engine.model.embedding import table_bytes, table_in_host
    from moedesk.engine.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg, context)
    # synthetic_model stores every parameter in `dtype` and keeps the rotary tables in float32, as built here; with
    # packed experts on a GPU, its non-expert weights packed (synthetic.packed_plan: as a load onto `device`).
    packed = packed_plan(cfg, expert_format, model=model, device=device)
    held = (sum(p.numel() for p in model.parameters()) * dtype.itemsize
            + sum(b.numel() * b.element_size() for b in model.buffers())
            - sum(packed_savings(packed, dtype.itemsize).values())
            - table_bytes(cfg, dtype.itemsize) * table_in_host(cfg, device))  # a GPU's bench pins its banks
    cache = model.new_cache(1, 1, dtype, "meta")
    return model_split(cfg, budget, context, dtype.itemsize, prefill_piece, held, cache.bytes_per_position(),
                       cache.bytes_per_row())


def expert_bytes(cfg: ModelConfig, expert_format: str, dtype: torch.dtype) -> int:
    """One routed expert's bytes as the bench stores it (a packed format's fallbacks included)."""
    from moedesk.engine.load.synthetic import expert_formats
    from moedesk.kernels.expert_weights import ExpertWeights

    gate_up, down = expert_formats(expert_format, cfg.hidden_size, cfg.moe_intermediate_size)
    return ExpertWeights.empty(1, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, gate_up_format=gate_up,
                               down_format=down, device="meta").expert_bytes


def planned_experts(split: BudgetSplit, one_expert: int, cfg: ModelConfig) -> int:
    """How many experts the placement makes resident with the split's share (engine.offload.placement)."""
    moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    return min(split.experts_fit(one_expert), moe_layers * cfg.num_experts)


def budget_for_experts(cfg: ModelConfig, count: int, context: int, expert_format: str = "dense",
                       device="cpu") -> float:
    """The least --gpu-budget (GiB) at which the bench on `device` keeps `count` experts resident at `context`
    positions (as prepare_synthetic splits it: the engine's prefill piece for the device)."""
    from moedesk.engine.generation.scheduler import default_prefill_chunk

    dtype = bench_dtype(device)
    whole = bench_split(cfg, 2**62, context, dtype, default_prefill_chunk(device), expert_format, device)
    fixed = whole.weights + whole.kv_cache + whole.workspace
    return (budget_holding(fixed, count * expert_bytes(cfg, expert_format, dtype)) + 16) / GIB  # 16: GiB's rounding


def layers_in_ram(cfg: ModelConfig, budget_gib: float, context: int, expert_format: str, device="cuda") -> int:
    """llama.cpp's `-ncmoe` at the bench's budget: a GGUF holds a layer's experts as one tensor, so the experts our
    split leaves room for go to the GPU as whole layers, and the MoE layers left over keep theirs in RAM."""
    from moedesk.engine.generation.scheduler import default_prefill_chunk

    dtype = bench_dtype(device)
    split = bench_split(cfg, int(budget_gib * GIB), context, dtype, default_prefill_chunk(device), expert_format,
                        device)
    moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    return moe_layers - planned_experts(split, expert_bytes(cfg, expert_format, dtype), cfg) // cfg.num_experts


if __name__ == "__main__":
    # for tests/perf scripts: python3 -m moedesk.bench.budget SHAPE LAYERS EXPERTS CONTEXT [FORMAT]  (the budget)
    # or python3 -m moedesk.bench.budget --ncmoe SHAPE LAYERS GIB CONTEXT FORMAT  (llama.cpp's -ncmoe at that budget)
    import sys

    from moedesk.engine.load.synthetic import shape_config

    if sys.argv[1] == "--ncmoe":
        shape, layers, gib, context, fmt = sys.argv[2:]
        print(layers_in_ram(shape_config(shape, int(layers) or None), float(gib), int(context), fmt))
        sys.exit()
    shape, layers, count, context, *fmt = sys.argv[1:]
    print(budget_for_experts(shape_config(shape, int(layers) or None), int(count), int(context),
                             fmt[0] if fmt else "dense", "cuda"))
