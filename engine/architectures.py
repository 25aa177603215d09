"""The supported architectures, each a few switches plus a weight-name map.

A checkpoint's config.json becomes a `ModelConfig`; its tensor names become moedesk's own
names (the module tree in `engine.model`). Anything in a checkpoint that would change the
computation and that moedesk does not implement is refused with a one-line error rather than
silently ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config import ModelConfig, RopeConfig
from engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    model_type: str
    moe_block: str | None = None  # the checkpoint's name of the MoE module; None: dense
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared_expert: bool = False
    qk_norm: str | None = None
    attention_bias: bool = False
    num_experts_key: str = "num_experts"
    expert_width_key: str = "moe_intermediate_size"
    norm_topk_prob_default: bool = False


ARCHITECTURES = {
    a.model_type: a
    for a in [
        Architecture("llama"),
        Architecture("qwen2", attention_bias=True),
        Architecture("mixtral", moe_block="block_sparse_moe", expert_proj=("w1", "w3", "w2"),
                     num_experts_key="num_local_experts", expert_width_key="intermediate_size",
                     norm_topk_prob_default=True),
        Architecture("qwen2_moe", moe_block="mlp", shared_expert=True, attention_bias=True),
        Architecture("qwen3_moe", moe_block="mlp", qk_norm="head", norm_topk_prob_default=True),
        Architecture("olmoe", moe_block="mlp", qk_norm="full", expert_width_key="intermediate_size"),
    ]
}

# Config fields whose non-default values change the computation in ways moedesk does not run.
_REFUSED_FIELDS = {
    "mlp_bias": (None, False),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "partial_rotary_factor": (None, 1.0),
    "use_qk_norm": (None, False),
}


def architecture_of(hf: dict, path) -> Architecture:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(path, f"unsupported architecture {model_type!r} (supported: {supported})")
    return ARCHITECTURES[model_type]


def parse_config(hf: dict, path="config.json") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    arch = architecture_of(hf, path)

    def need(key):
        if key not in hf or hf[key] is None:
            raise UnsupportedModelError(path, f"config has no {key!r}")
        return hf[key]

    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(path, f"unsupported hidden_act {act!r} (moedesk runs SwiGLU/silu models)")
    for key, allowed in _REFUSED_FIELDS.items():
        if key in hf and hf[key] not in allowed:
            raise UnsupportedModelError(path, f"unsupported config field {key}={hf[key]!r}")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError(path, "unsupported config field use_sliding_window=true")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    layers = need("num_hidden_layers")
    num_experts = 0
    if arch.moe_block:
        # Hub checkpoints and newer transformers disagree on the key's name.
        num_experts = hf.get(arch.num_experts_key) or hf.get("num_local_experts") or need(arch.num_experts_key)
    moe_layers = tuple(_is_moe_layer(hf, i, num_experts) for i in range(layers))
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    max_pos = need("max_position_embeddings")
    if hf.get("sliding_window") and arch.model_type == "mixtral":
        # Mixtral's window only matters past it: keep sequences inside it and stay exact.
        max_pos = min(max_pos, hf["sliding_window"])
    return ModelConfig(
        arch=arch.model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=hf.get("intermediate_size") or 0,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        rope=_parse_rope(hf, path),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch.attention_bias))),
        qk_norm=arch.qk_norm,
        clip_qkv=hf.get("clip_qkv"),
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
        moe_intermediate_size=need(arch.expert_width_key) if num_experts else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", arch.norm_topk_prob_default)),
        shared_expert_intermediate_size=(hf.get("shared_expert_intermediate_size") or 0) if arch.shared_expert else 0,
        moe_layers=moe_layers,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _is_moe_layer(hf: dict, layer: int, num_experts: int) -> bool:
    if num_experts == 0:
        return False
    if layer in (hf.get("mlp_only_layers") or []):
        return False
    step = hf.get("decoder_sparse_step") or 1
    return (layer + 1) % step == 0


def _parse_rope(hf: dict, path) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; checkpoints on the Hub carry rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if params.get("rope_type") else scaling
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=source["factor"])
    if kind == "llama3":
        return RopeConfig(
            theta=theta, kind="llama3", factor=source["factor"],
            low_freq_factor=source["low_freq_factor"], high_freq_factor=source["high_freq_factor"],
            original_max_position_embeddings=source["original_max_position_embeddings"],
        )
    raise UnsupportedModelError(path, f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


_LAYER = r"model\.layers\.(\d+)\."


def weight_name_map(cfg: ModelConfig) -> list[tuple[re.Pattern, str]]:
    """Regex rules from checkpoint tensor names to moedesk's module names."""
    arch = ARCHITECTURES[cfg.arch]
    rules = [
        (r"model\.embed_tokens\.weight", "embed.weight"),
        (r"model\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", "lm_head.weight"),
        (_LAYER + r"input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
        (_LAYER + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
        (_LAYER + r"self_attn\.([qkvo])_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
        (_LAYER + r"self_attn\.([qk])_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
        (_LAYER + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2.weight"),
    ]
    if arch.moe_block:
        block = _LAYER + re.escape(arch.moe_block) + r"\."
        rules.append((block + r"gate\.weight", r"layers.\1.moe.router.weight"))
        for ours, theirs in zip(("gate", "up", "down"), arch.expert_proj):
            rules.append((block + r"experts\.(\d+)\." + theirs + r"\.weight", rf"layers.\1.moe.experts.\2.{ours}.weight"))
    if arch.shared_expert:
        rules.append((_LAYER + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"layers.\1.moe.shared.\2.weight"))
        rules.append((_LAYER + r"mlp\.shared_expert_gate\.weight", r"layers.\1.moe.shared_gate.weight"))
    return [(re.compile(pattern + "$"), target) for pattern, target in rules]


def is_ignored_tensor(name: str) -> bool:
    """Tensors some checkpoints carry that hold nothing the forward pass needs."""
    return name.endswith("rotary_emb.inv_freq")


def map_weight_name(rules, name: str) -> str | None:
    """Our name for a checkpoint tensor, or None when no rule knows it."""
    for pattern, target in rules:
        m = pattern.match(name)
        if m:
            return m.expand(target)
    return None
