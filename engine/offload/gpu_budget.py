"""How a GPU budget splits between what every token needs and resident experts, at a given context.

The rule placement follows for weights, applied to the KV cache too: what every token reads goes on the GPU
first, experts take what is left. Every decode step reads the non-expert weights and the whole KV cache of its
sequence in every layer, while an expert is read only by the tokens routed to it, so the cache outranks any
expert: a longer context leaves fewer experts resident, never a cache in RAM. Attention's workspace (what a
prefill piece allocates while it attends over the whole context) is set aside too, so the deepest prefill
still fits beside the cache.

Pure functions of sizes: no tensors, no devices, unit-tested on the real shapes' numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from moedesk.engine.errors import MoedeskError
from moedesk.engine.memory_fit import gib
from moedesk.engine.model.config import ModelConfig

GIB = 2**30
# Allocator slack (fragmentation, cuBLAS workspaces) kept free inside an explicit budget.
SLACK = 0.05


class ContextBudgetError(MoedeskError):
    """The budget cannot hold the non-expert weights and the KV cache of the context asked for."""


@dataclass(frozen=True)
class BudgetSplit:
    """Bytes of the GPU budget per use at one context; `experts` is what resident experts may take."""
    budget: int
    weights: int  # non-expert weights: attention, norms, routers, embeddings, the head
    kv_cache: int  # every attention layer's keys and values, `rows` sequences of `context` positions
    workspace: int  # a prefill piece's activations and attention temporaries at the deepest position
    slack: int
    experts: int
    context: int
    rows: int

    @property
    def fixed(self) -> int:
        """What the context needs whatever the experts: weights, cache, workspace and slack."""
        return self.weights + self.kv_cache + self.workspace + self.slack

    def experts_fit(self, expert_bytes: int) -> int:
        return self.experts // expert_bytes if expert_bytes > 0 else 0


def non_expert_bytes(cfg: ModelConfig, dtype_bytes: int, packed: dict | None = None,
                     table_in_host: bool = False) -> int:
    """Bytes of the weights outside the routed experts, in 16 bits (or `dtype_bytes`) as the GPU holds them, less
    what the weights in `packed` save staying packed (engine.memory_fit.packed_savings), and less the token table
    where it stays in host memory (engine.model.embedding)."""
    from moedesk.engine.memory_fit import layer_weights, packed_savings

    total = cfg.vocab_size * cfg.hidden_size * ((1 if cfg.tie_word_embeddings else 2) - table_in_host)
    total += sum(layer_weights(cfg, layer)[1] for layer in range(cfg.num_layers))
    return total * dtype_bytes - sum(packed_savings(packed, dtype_bytes).values())


def kv_bytes_per_position(cfg: ModelConfig, dtype_bytes: int) -> int:
    """One position's keys and values over every full-attention layer (engine.model.cache.kv; Gated DeltaNet layers
    keep a state per sequence instead, sliding layers a ring per sequence), or for latent attention its latent and
    rotary key (engine.model.cache.positional.LatentCache)."""
    if cfg.kv_lora_rank:
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    attending = sum(not (cfg.is_linear_layer(layer) or cfg.is_sliding_layer(layer)) for layer in range(cfg.num_layers))
    return attending * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def prefill_workspace_bytes(cfg: ModelConfig, piece: int, context: int, dtype_bytes: int) -> int:
    """The most a prefill piece of `piece` tokens attending over `context` positions allocates at once beyond
    weights and cache, with the GPU's attention path (engine.model.transformer.attention): the boolean mask and
    its additive form [piece, context] (rows 16-aligned); keys and values repeated to every query head for the
    memory-efficient kernel (one layer at a time); the piece's hidden states, q/k/v, and its routed tokens' expert
    intermediates. The kernel itself is flash-style: no [heads, piece, context] score matrix is ever made."""
    aligned = -(-context // 16) * 16
    mask = piece * context + piece * aligned * dtype_bytes
    repeated_kv = 2 * cfg.num_heads * context * cfg.head_dim * dtype_bytes
    qkv = piece * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * dtype_bytes
    hidden = 4 * piece * cfg.hidden_size * dtype_bytes  # residual, normed input, attention output, MoE output
    width = cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    routed = piece * max(1, cfg.num_experts_per_tok) * 3 * width * dtype_bytes  # gate|up, then the product
    logits = cfg.vocab_size * 4  # one row per sequence: the last token's
    return mask + repeated_kv + qkv + hidden + routed + logits


def split_gpu_budget(budget: int, weights: int, kv_per_position: int, context: int, workspace: int,
                     rows: int = 1, kv_per_row: int = 0, slack: float = SLACK) -> BudgetSplit:
    """The budget's split at `context` positions for `rows` sequences: weights, KV cache, workspace and slack
    first, experts the rest. ContextBudgetError, in one line naming the longest context that fits, when the
    fixed part alone exceeds the budget. kv_per_row: what a row's cache costs whatever its length (a sliding
    window's ring, a recurrent state)."""
    if min(budget, weights, kv_per_position, context, workspace, kv_per_row) < 0 or rows < 1:
        raise ValueError("sizes must be >= 0 and rows >= 1")
    kv = rows * (context * kv_per_position + kv_per_row)
    kept = int(budget * slack)
    split = BudgetSplit(budget, weights, kv, workspace, kept, budget - weights - kv - workspace - kept, context, rows)
    if split.experts < 0:
        raise ContextBudgetError(
            f"a {gib(budget)} GPU budget cannot hold the weights ({gib(weights)}) and the KV cache of {rows} x "
            f"{context} positions ({gib(kv)}); {_advice(budget, weights, kv_per_position, workspace, rows, kv_per_row, kept)}")
    return split


def model_split(cfg: ModelConfig, budget: int, context: int, dtype_bytes: int, prefill_piece: int,
                weights: int | None = None, kv_per_position: int | None = None, kv_per_row: int = 0,
                packed: dict | None = None, table_in_host: bool = False) -> BudgetSplit:
    """An explicit --gpu-budget's split for a model: its non-expert weights, one sequence's KV cache at the whole
    context the engine reserves, a prefill piece's workspace at that depth, slack, then experts (ContextBudgetError
    when the fixed part does not fit). The loaded model's and cache's own sizes once they exist; before, a floor
    from the config (no norms, biases or sliding rings; for latent attention, whose projections layer_weights does
    not model, the embeddings alone): never more than the loaded sizes, so a refusal then is certain. packed: the
    weights that will stay packed (MOEDESK_PACKED_WEIGHTS; engine.load.loader.packed_plan), counted packed;
    table_in_host: the token table will stay in host memory (engine.model.embedding.table_in_host), not counted."""
    if weights is None:
        from moedesk.engine.memory_fit import packed_savings

        table = cfg.vocab_size * cfg.hidden_size * dtype_bytes
        head = 0 if cfg.tie_word_embeddings else table - packed_savings(packed, dtype_bytes).get("head", 0)
        weights = (table * (not table_in_host) + head if cfg.kv_lora_rank
                   else non_expert_bytes(cfg, dtype_bytes, packed, table_in_host))
    per = kv_bytes_per_position(cfg, dtype_bytes) if kv_per_position is None else kv_per_position

    def at(positions: int) -> BudgetSplit:
        workspace = prefill_workspace_bytes(cfg, min(prefill_piece, positions), positions, dtype_bytes)
        return split_gpu_budget(budget, weights, per, positions, workspace, 1, kv_per_row)

    try:
        return at(context)
    except ContextBudgetError:
        pass
    # The workspace grows with the context too: the longest that fits, by bisection (the fixed part only grows).
    fits, too_long = 0, context
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        try:
            at(middle)
            fits = middle
        except ContextBudgetError:
            too_long = middle
    advice = f"use a context of at most {fits} or raise --gpu-budget" if fits else "raise --gpu-budget"
    raise ContextBudgetError(f"a {gib(budget)} GPU budget cannot hold the weights ({gib(weights)}) and the KV cache "
                             f"of {context} positions ({gib(context * per + kv_per_row)}); {advice}")


def budget_holding(fixed: int, experts: int, slack: float = SLACK) -> int:
    """The least budget whose split leaves `experts` bytes for experts beside `fixed` (weights, cache, workspace)."""
    budget = int((fixed + experts) / (1 - slack))
    while budget - fixed - int(budget * slack) < experts:
        budget += 1
    return budget


def longest_context(budget: int, weights: int, kv_per_position: int, workspace: int, rows: int = 1,
                    kv_per_row: int = 0, slack: float = SLACK) -> int:
    """The most positions whose cache fits beside the weights (workspace as given: an upper bound at any depth)."""
    room = budget - weights - workspace - int(budget * slack) - rows * kv_per_row
    return max(0, room // (rows * kv_per_position)) if kv_per_position else 0


def _advice(budget, weights, kv_per_position, workspace, rows, kv_per_row, kept) -> str:
    fits = longest_context(budget, weights, kv_per_position, workspace, rows, kv_per_row, kept / budget if budget else 0)
    return f"use a context of at most {fits} or raise --gpu-budget" if fits else "raise --gpu-budget"
