"""One model description for every supported architecture.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.x MoE and dense Llama-family models differ in a handful of
switches (shared expert, q/k norm, top-k normalisation, routing, partial RoPE, biases); `ModelConfig` holds those
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
    # yarn (gpt-oss, DeepSeek-V3): frequencies blended between `factor` times slower and as they are, by how many
    # turns a dimension makes over the original context; cos and sin scaled by attention_factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


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
    attention_out_bias: bool = False  # a bias on the output projection too (gpt-oss)
    norm_weight_first: bool = False  # gpt-oss's norms apply their weight in float32, then round (engine.model.norm)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head that takes part in the softmax, attends nothing
    sliding_window: int = 0  # keys a sliding layer's token sees: itself and the window - 1 before it
    sliding_layers: tuple[bool, ...] = ()  # which layers slide (empty: none)
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over the whole projection (OLMoE)
    clip_qkv: float | None = None
    rotary_dim: int = 0  # the leading dims of each head that RoPE turns (GLM-4.x: half); 0: all of head_dim
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # an always-on expert beside the routed ones
    shared_expert_gate: bool = True  # Qwen2-MoE scales it by a sigmoid gate; GLM-4.x adds it as it is
    # How router logits become expert weights (engine.model.routing): "softmax" over every expert, then the
    # top k; "topk_softmax" (gpt-oss): the top k logits, then a softmax over them; "sigmoid" (DeepSeek-V3, GLM-4.x): sigmoid scores, chosen with a correction bias among the best
    # `topk_group` of `n_group` groups, scaled by routed_scaling_factor.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    # gpt-oss's experts: biases after both matrices and a clamped SwiGLU (kernels.expert_weights.ClampedSwiGLU);
    # swiglu_limit 0: plain silu(gate) * up.
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 0.0
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mtp_layers: int = 0  # checkpoint layers after the last one, for multi-token prediction: not loaded
    # Latent attention (engine.model.mla: DeepSeek-V3, GLM-4.7-Flash); kv_lora_rank 0: ordinary attention. head_dim
    # is then the query/key width (nope + rope dims) and num_kv_heads num_heads; the cache holds the latent.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries straight from the hidden state
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Qwen3-Next / Qwen3.5-MoE: Gated DeltaNet layers (engine.model.delta_net) beside gated full attention.
    linear_layers: tuple[bool, ...] = ()  # which layers are Gated DeltaNet (empty: none)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_gate: bool = False  # q_proj also gives a per-channel gate: attention's output times sigmoid(gate)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), weight stored zero-centred (Qwen3-Next)

    def is_sliding_layer(self, layer: int) -> bool:
        return bool(self.sliding_window) and bool(self.sliding_layers) and self.sliding_layers[layer]

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def is_recurrent(self) -> bool:
        """Some layers keep a recurrent state per sequence rather than keys and values per position."""
        return any(self.linear_layers)

    @property
    def rope_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size
