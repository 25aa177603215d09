"""One model description for every supported architecture.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and dense Llama-family models differ in a handful of
switches (shared expert, q/k norm, top-k normalisation, biases); `ModelConfig` holds those
switches and the shapes, and `engine.model.architectures` fills it from a checkpoint's config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the checkpoint's model_type: llama, qwen2, mixtral, qwen2_moe, qwen3_moe, olmoe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width (dense layers only)
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over the whole projection (OLMoE)
    clip_qkv: float | None = None
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert behind a sigmoid gate
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size
