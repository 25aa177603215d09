"""The supported architectures, each a few switches plus a weight-name map.

A checkpoint's config.json becomes a `ModelConfig`; its tensor names become moedesk's own
names (the module tree in `engine.model.transformer`). Anything in a checkpoint that would change the
computation and that moedesk does not implement is refused with a one-line error rather than
silently ignored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from moedesk.engine import json_read
from moedesk.engine.model.config import ModelConfig, RopeConfig
from moedesk.engine.errors import CheckpointError, UnsupportedModelError


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
    shared_expert_name: str = "shared_expert"  # the checkpoint's module name of the shared expert
    router: str = "softmax"  # see ModelConfig.router
    partial_rotary: bool = False  # reads partial_rotary_factor (others refuse it)
    router_name: str = "gate"  # the checkpoint's name of the router inside the MoE module
    latent_attention: bool = False  # DeepSeek's MLA
    delta_net: bool = False  # Gated DeltaNet layers beside gated full attention (Qwen3-Next, Qwen3.5-MoE)
    score_bias_name: str = "gate.e_score_correction_bias"  # a sigmoid router's correction bias, in the MoE module


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
        # GLM-4.5/4.6/4.7 and -Air: q/k norm only where use_qk_norm says so (parsed below).
        Architecture("glm4_moe", moe_block="mlp", shared_expert=True, num_experts_key="n_routed_experts",
                     norm_topk_prob_default=True, shared_expert_name="shared_experts", router="sigmoid",
                     partial_rotary=True),
        # gpt-oss: sinks, sliding and full layers alternating, biases everywhere, a clamped SwiGLU. Its experts
        # are fused in the checkpoint; engine.load.fused_experts shows them one by one, as the rest expect.
        Architecture("deepseek_v3", moe_block="mlp", shared_expert=True, num_experts_key="n_routed_experts",
                     norm_topk_prob_default=True, shared_expert_name="shared_experts", router="sigmoid",
                     latent_attention=True),
        # Qwen3-Next and Qwen3.5/3.6-MoE: Gated DeltaNet layers, every fourth layer gated full attention with a
        # quarter of each head rotated, zero-centred norms, many small experts and a gated shared expert.
        Architecture("qwen3_next", moe_block="mlp", shared_expert=True, qk_norm="head", norm_topk_prob_default=True,
                     partial_rotary=True, delta_net=True),
        Architecture("qwen3_5_moe", moe_block="mlp", shared_expert=True, qk_norm="head", norm_topk_prob_default=True,
                     partial_rotary=True, delta_net=True),
        # GLM-4.7-Flash: DeepSeek-V3's attention and routing; its dense layers listed in mlp_layer_types.
        Architecture("glm4_moe_lite", moe_block="mlp", shared_expert=True, num_experts_key="n_routed_experts",
                     norm_topk_prob_default=True, shared_expert_name="shared_experts", router="sigmoid",
                     latent_attention=True),
        Architecture("gpt_oss", moe_block="mlp", num_experts_key="num_local_experts",
                     expert_width_key="intermediate_size", attention_bias=True, router="topk_softmax",
                     router_name="router"),
        # MiniMax-M2: Mixtral's module names, q/k norms over all heads at once (OLMoE's), part of each head rotated
        # (rotary_dim), sigmoid routing with a correction bias beside the router, the top k always renormalised.
        Architecture("minimax_m2", moe_block="block_sparse_moe", expert_proj=("w1", "w3", "w2"), qk_norm="full",
                     num_experts_key="num_local_experts", expert_width_key="intermediate_size",
                     norm_topk_prob_default=True, router="sigmoid", partial_rotary=True,
                     score_bias_name="e_score_correction_bias"),
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


# Far above any released model, far below what would exhaust memory before the weights are read: the
# model is first built as empty modules, one per layer and expert, from these numbers alone.
_LIMITS = {"layers": 1024, "experts": 4096, "heads": 1024}


def parse_config(hf: dict, path="config.json", tensors: dict | None = None) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict, checked before anything is allocated.

    Every dimension must be a positive integer within bounds (one line naming the field otherwise),
    and where the weights' shapes are known they must agree: `tensors` ({name: shape}) when the
    caller has them, else the safetensors headers of `path` when it is a model folder (read
    without loading a tensor).
    """
    cfg = _parse_config(hf, path)
    if tensors is None:
        tensors = _safetensors_shapes(path)
    if tensors is not None:
        check_against_weights(cfg, tensors, path)
    return cfg


# model_types that name an architecture moedesk runs under another name: Kimi-K2 ships DeepSeek-V3's architecture as
# "kimi_k2" (so that engines can tell them apart), and Qwen3.5-MoE's text model saved alone is "qwen3_5_moe_text".
SAME_AS = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe"}


# Multimodal model_types whose text model moedesk runs (its config nested as text_config), and that model's
# architecture: Qwen3.5-MoE's, and Kimi-K2.5's, which is Kimi-K2's (DeepSeek-V3's) with a vision tower beside it.
TEXT_MODELS = {"qwen3_5_moe": "qwen3_5_moe", "kimi_k25": "deepseek_v3"}


def text_config(hf: dict) -> dict:
    """The config of the text model moedesk runs: a multimodal checkpoint's text_config (`TEXT_MODELS`, its keys over
    the outer config's), a model_type of `SAME_AS` under the architecture's; any other as it is."""
    if hf.get("model_type") in SAME_AS:
        return {**hf, "model_type": SAME_AS[hf["model_type"]]}
    inner = hf.get("text_config")
    if hf.get("model_type") not in TEXT_MODELS or not isinstance(inner, dict):
        return hf
    merged = {key: value for key, value in hf.items() if key not in ("text_config", "vision_config")}
    return {**merged, **inner, "model_type": TEXT_MODELS[hf["model_type"]]}


def reads_images(hf: dict) -> bool:
    return isinstance(hf.get("vision_config"), dict)


def _parse_config(hf: dict, path) -> ModelConfig:
    hf = text_config(hf)
    arch = architecture_of(hf, path)

    def need(key):
        if key not in hf or hf[key] is None:
            raise UnsupportedModelError(path, f"config has no {key!r}")
        return hf[key]

    def count(key, value=None, minimum=1, limit=None):
        """A config integer, checked: one line naming the field when it is not a sane count."""
        value = need(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(path, f"config {key} must be an integer, got {_show(value)}")
        if value < minimum or limit is not None and value > limit:
            bounds = f">= {minimum}" if limit is None else f"from {minimum} to {limit}"
            raise CheckpointError(path, f"config {key} must be {bounds}, got {_show(value)}")
        return value

    def positive(key, default):
        value = hf.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise CheckpointError(path, f"config {key} must be a positive number, got {_show(value)}")
        return float(value)

    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(path, f"unsupported hidden_act {act!r} (moedesk runs SwiGLU/silu models)")
    for key, allowed in _REFUSED_FIELDS.items():
        if arch.partial_rotary and key in ("partial_rotary_factor", "use_qk_norm"):
            continue
        if key in hf and hf[key] not in allowed:
            raise UnsupportedModelError(path, f"unsupported config field {key}={hf[key]!r}")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError(path, "unsupported config field use_sliding_window=true")
    if arch.model_type == "minimax_m2":
        hf = _minimax_m2_checked(hf, path)

    hidden, heads = count("hidden_size"), count("num_attention_heads", limit=_LIMITS["heads"])
    layers = count("num_hidden_layers", limit=_LIMITS["layers"])
    vocab = count("vocab_size")
    kv_heads = count("num_key_value_heads", hf.get("num_key_value_heads") or heads, limit=heads)
    if heads % kv_heads:
        raise CheckpointError(path, f"config num_attention_heads={heads} is not a multiple of "
                                    f"num_key_value_heads={kv_heads}")
    if not hf.get("head_dim") and hidden % heads and not arch.latent_attention:  # MLA's widths are its own keys
        raise CheckpointError(path, f"config hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                                    f"(and no head_dim is given)")
    head_dim = count("head_dim", hf.get("head_dim") or hidden // heads)
    num_experts = 0
    if arch.moe_block:
        # Hub checkpoints and newer transformers disagree on the key's name.
        num_experts = count(arch.num_experts_key, hf.get(arch.num_experts_key) or hf.get("num_local_experts")
                            or need(arch.num_experts_key), limit=_LIMITS["experts"])
    top_k = count("num_experts_per_tok", hf.get("num_experts_per_tok"), limit=num_experts) if num_experts else 0
    expert_width = count(arch.expert_width_key) if num_experts else 0
    moe_layers = tuple(_is_moe_layer(hf, i, num_experts, path) for i in range(layers))
    if "first_k_dense_replace" in hf:  # DeepSeek-V3, GLM-4.x: the first k layers are dense
        dense = count("first_k_dense_replace", hf["first_k_dense_replace"], minimum=0)
        moe_layers = tuple(moe and i >= dense for i, moe in enumerate(moe_layers))
    if "mlp_layer_types" in hf:  # GLM-4.7-Flash: "dense" or "sparse" for each layer
        kinds = hf["mlp_layer_types"]
        if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
            raise CheckpointError(path, f"config mlp_layer_types must list dense or sparse for each of the {layers} "
                                        f"layers, got {_show(kinds)}")
        moe_layers = tuple(moe and kind == "sparse" for moe, kind in zip(moe_layers, kinds))
    intermediate = count("intermediate_size", hf.get("intermediate_size") or 0, minimum=0)
    if intermediate == 0 and not all(moe_layers):
        raise CheckpointError(path, "config intermediate_size must be >= 1 for a model with dense MLP layers")
    shared = 0
    if arch.shared_expert and "n_shared_experts" in hf:  # DeepSeek-V3, GLM-4.x: n experts' width, ungated
        shared = count("n_shared_experts", hf.get("n_shared_experts") or 0, minimum=0) * expert_width
    elif arch.shared_expert:
        shared = count("shared_expert_intermediate_size", hf.get("shared_expert_intermediate_size") or 0, minimum=0)
    routing = {}
    if arch.router == "sigmoid":
        groups = count("n_group", hf.get("n_group") or 1, limit=num_experts)
        if num_experts % groups:
            raise CheckpointError(path, f"config n_routed_experts={num_experts} is not a multiple of n_group={groups}")
        top_groups = count("topk_group", hf.get("topk_group") or 1, limit=groups)
        if top_groups * (num_experts // groups) < top_k:
            raise CheckpointError(path, f"config topk_group={top_groups} of n_group={groups} leaves fewer experts "
                                        f"than num_experts_per_tok={top_k}")
        routing = dict(router="sigmoid", n_group=groups, topk_group=top_groups,
                       routed_scaling_factor=positive("routed_scaling_factor", 1.0))
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    # An id outside the vocabulary is never sampled: every reply would run to max_new_tokens.
    for token in eos_ids:
        count("eos_token_id", token, minimum=0, limit=vocab - 1)
    bos = hf.get("bos_token_id")
    if bos is not None:
        count("bos_token_id", bos, minimum=0, limit=vocab - 1)
    max_pos = count("max_position_embeddings")
    extra = {}  # the switches of one family: MLA's, gpt-oss's
    if arch.latent_attention:
        extra = _latent_attention(hf, heads, count, path)
        head_dim, kv_heads = extra.pop("head_dim"), heads
    if arch.model_type == "gpt_oss":
        extra = _gpt_oss_switches(hf, layers, count, positive, path)
    if arch.delta_net:
        if hf.get("attn_output_gate", True) is not True:  # Qwen3.5 says so; Qwen3-Next's attention is always gated
            raise UnsupportedModelError(path, f"unsupported config field attn_output_gate="
                                              f"{_show(hf['attn_output_gate'])}")
        extra = _delta_net_switches(hf, layers, count, path)
        if arch.model_type == "qwen3_5_moe":  # its router always renormalises the top k
            hf = {**hf, "norm_topk_prob": True}
    if hf.get("sliding_window") and arch.model_type == "mixtral":
        # Mixtral's window only matters past it: keep sequences inside it and stay exact.
        max_pos = min(max_pos, count("sliding_window"))
    clip = hf.get("clip_qkv")
    rope = _parse_rope(hf, path)
    if arch.latent_attention:
        extra["attention_scale"] = _latent_scale(hf, rope, head_dim)
    qk_norm = arch.qk_norm
    if arch.model_type == "glm4_moe" and hf.get("use_qk_norm"):
        qk_norm = "head"
    return ModelConfig(
        arch=arch.model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=positive("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        rope=rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch.attention_bias))),
        qk_norm=qk_norm,
        clip_qkv=None if clip is None else positive("clip_qkv", clip),
        rotary_dim=(_rotary_dim(hf, head_dim, path) if arch.partial_rotary
                    else extra.get("qk_rope_head_dim", 0) if arch.latent_attention else 0),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_width,
        norm_topk_prob=bool(hf.get("norm_topk_prob", arch.norm_topk_prob_default)),
        shared_expert_intermediate_size=shared,
        shared_expert_gate="n_shared_experts" not in hf,
        moe_layers=moe_layers,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        **extra,
        # DeepSeek-V3 and GLM-4.x say num_nextn_predict_layers, MiniMax-M2 num_mtp_modules
        mtp_layers=count("num_nextn_predict_layers", hf.get("num_nextn_predict_layers") or hf.get("num_mtp_modules")
                         or 0, minimum=0, limit=_LIMITS["layers"]),
        **routing,
    )


# MiniMax-M2's config keys for what transformers' implementation always does: anything else is another model.
_MINIMAX_M2_FIXED = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                     "qk_norm_type": "per_layer", "shared_intermediate_size": 0}


def _minimax_m2_checked(hf: dict, path) -> dict:
    """MiniMax-M2's config, its fixed switches checked (one line for a value the reference does not run), the top k
    always renormalised (transformers' router divides by their sum whatever the config says)."""
    for key, fixed in _MINIMAX_M2_FIXED.items():
        if hf.get(key) is not None and hf[key] != fixed:
            raise UnsupportedModelError(path, f"unsupported config field {key}={_show(hf[key])} (MiniMax-M2 runs "
                                              f"{key}={_show(fixed)})")
    return {**hf, "norm_topk_prob": True}


def _latent_attention(hf: dict, heads: int, count, path) -> dict:
    """MLA's dims; head_dim becomes the query/key width (nope + rope)."""
    rope, nope = count("qk_rope_head_dim"), count("qk_nope_head_dim")
    if rope % 2:
        raise CheckpointError(path, f"config qk_rope_head_dim must be even, got {rope}")
    return dict(kv_lora_rank=count("kv_lora_rank"), q_lora_rank=count("q_lora_rank", hf.get("q_lora_rank") or 0, minimum=0),
                qk_rope_head_dim=rope, v_head_dim=count("v_head_dim"), head_dim=rope + nope,
                rope_interleave=bool(hf.get("rope_interleave", True)))


def _latent_scale(hf: dict, rope: RopeConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale: head_dim ** -0.5, times yarn's mscale squared where mscale_all_dim is set."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    scale = head_dim ** -0.5
    all_dim = params.get("mscale_all_dim") if isinstance(params, dict) else None
    if rope.kind != "default" and all_dim:
        mscale = 1.0 if rope.factor <= 1 else 0.1 * all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def _gpt_oss_switches(hf: dict, layers: int, count, positive, path) -> dict:
    """gpt-oss's attention and expert switches: the window and which layers slide (layer_types, else every other
    layer from the first, as the reference defaults), biases, sinks, the clamped SwiGLU."""
    kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise CheckpointError(path, f"config layer_types must list sliding_attention or full_attention for each of "
                                    f"the {layers} layers, got {_show(kinds)}")
    return dict(attention_out_bias=bool(hf.get("attention_bias", True)), attention_sinks=True, norm_weight_first=True,
                sliding_window=count("sliding_window"), sliding_layers=tuple(k == "sliding_attention" for k in kinds),
                router="topk_softmax", router_bias=True, expert_bias=True,
                swiglu_alpha=positive("swiglu_alpha", 1.702), swiglu_limit=positive("swiglu_limit", 7.0))


def _delta_net_switches(hf: dict, layers: int, count, path) -> dict:
    """Which layers are Gated DeltaNet (layer_types, else every layer but each full_attention_interval-th, as the
    reference defaults) and their dims; full-attention layers get the output gate, every norm is zero-centred."""
    interval = count("full_attention_interval", hf.get("full_attention_interval") or 4)
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise CheckpointError(path, f"config layer_types must list linear_attention or full_attention for each of "
                                    f"the {layers} layers, got {_show(kinds)}")
    key_heads = count("linear_num_key_heads", limit=_LIMITS["heads"])
    value_heads = count("linear_num_value_heads", limit=_LIMITS["heads"])
    if value_heads % key_heads:
        raise CheckpointError(path, f"config linear_num_value_heads={value_heads} is not a multiple of "
                                    f"linear_num_key_heads={key_heads}")
    return dict(linear_layers=tuple(k == "linear_attention" for k in kinds), linear_key_heads=key_heads,
                linear_value_heads=value_heads, linear_key_dim=count("linear_key_head_dim"),
                linear_value_dim=count("linear_value_head_dim"),
                linear_conv_kernel=count("linear_conv_kernel_dim", hf.get("linear_conv_kernel_dim") or 4, minimum=2,
                                         limit=64),
                attention_gate=True, norm_offset=True)


def _rotary_dim(hf: dict, head_dim: int, path) -> int:
    """How many of each head's dims RoPE turns: head_dim times partial_rotary_factor (in rope_parameters for
    transformers >= 5, at the top level on the Hub), an even number; 0 where that is all of them."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None and hf.get("model_type") == "minimax_m2" and hf.get("rotary_dim") is not None:
        factor = hf["rotary_dim"]  # the released MiniMax-M2 configs' own key: dims, not a share
        factor = factor / head_dim if isinstance(factor, int) and not isinstance(factor, bool) else factor
    if factor is None:
        # transformers' defaults: GLM-4.x turns half of each head, Qwen3-Next and Qwen3.5-MoE a quarter
        factor = {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_moe": 0.25}.get(hf.get("model_type"), 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(path, f"config partial_rotary_factor must be in (0, 1], got {_show(factor)}")
    dims = int(head_dim * factor)
    if dims < 2 or dims % 2:
        raise CheckpointError(path, f"config partial_rotary_factor={factor} turns {dims} of head_dim={head_dim} "
                                    f"dims (must be an even number >= 2)")
    return 0 if dims == head_dim else dims


def _is_moe_layer(hf: dict, layer: int, num_experts: int, path) -> bool:
    if num_experts == 0:
        return False
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise CheckpointError(path, f"config mlp_only_layers must be a list of layer numbers, got {_show(dense)}")
    if layer in dense:
        return False
    step = hf.get("decoder_sparse_step") or 1
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise CheckpointError(path, f"config decoder_sparse_step must be an integer >= 1, got {_show(step)}")
    return (layer + 1) % step == 0


def _show(value, limit: int = 40) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- the config against the weights -------------------------------------------------------------

def _safetensors_shapes(path) -> dict | None:
    """{tensor name: shape} from the safetensors headers of a model folder; None when `path` is not one,
    or its files cannot be read (the checkpoint reports that itself, in its own words)."""
    folder = Path(path)
    try:
        if not folder.is_dir():
            return None
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({folder / f for f in json_read.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            return None
        from safetensors import safe_open

        shapes = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        return shapes
    except Exception:  # noqa: BLE001 -- see the docstring
        return None


_LAYER_NUMBER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_NUMBER = re.compile(r"model\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def check_against_weights(cfg: ModelConfig, tensors: dict, path) -> None:
    """Raise CheckpointError (one line) where the config disagrees with the weights' names or shapes
    (Hugging Face names): the layer and expert counts, and every dimension that sizes an allocation."""
    layers = {int(m.group(1)) for name in tensors if (m := _LAYER_NUMBER.match(name))}
    layers -= set(range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers))  # there or not: never loaded
    if layers and layers != set(range(cfg.num_layers)):
        raise CheckpointError(path, f"config num_hidden_layers={cfg.num_layers}, but the weights have layers "
                                    f"{_span(layers)}")
    experts: dict[int, set] = {}
    for name in tensors:
        if m := _EXPERT_NUMBER.match(name):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    for layer, found in sorted(experts.items()):
        if found != set(range(cfg.num_experts)):
            raise CheckpointError(path, f"config says {cfg.num_experts} experts per layer, but layer {layer} of the "
                                        f"weights has experts {_span(found)}")
    arch = ARCHITECTURES[cfg.arch]
    h = cfg.hidden_size
    full = next((i for i in range(cfg.num_layers) if not cfg.is_linear_layer(i)), 0)
    gated = 2 if cfg.attention_gate else 1  # the query's heads, each followed by its gate's
    expected = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), "vocab_size, hidden_size"),
        f"model.layers.{full}.self_attn.q_proj.weight": ((gated * cfg.num_heads * cfg.head_dim, h),
                                                         "num_attention_heads * head_dim, hidden_size"),
        f"model.layers.{full}.self_attn.k_proj.weight": ((cfg.num_kv_heads * cfg.head_dim, h),
                                                         "num_key_value_heads * head_dim, hidden_size"),
    }
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            block = f"model.layers.{layer}.{arch.moe_block}"
            expected[f"{block}.{arch.router_name}.weight"] = ((cfg.num_experts, h), "num_experts, hidden_size")
            expected[f"{block}.experts.0.{arch.expert_proj[0]}.weight"] = ((cfg.moe_intermediate_size, h),
                                                                           f"{arch.expert_width_key}, hidden_size")
            if cfg.shared_expert_intermediate_size:
                expected[f"model.layers.{layer}.mlp.{arch.shared_expert_name}.gate_proj.weight"] = (
                    (cfg.shared_expert_intermediate_size, h), "shared_expert_intermediate_size, hidden_size")
            break
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            expected[f"model.layers.{layer}.mlp.gate_proj.weight"] = ((cfg.intermediate_size, h),
                                                                      "intermediate_size, hidden_size")
            break
    for name, (shape, fields) in expected.items():
        if name in tensors and tuple(tensors[name]) != shape:
            raise CheckpointError(path, f"tensor {name} has shape {tuple(tensors[name])}, the config implies "
                                        f"{shape} ({fields})")


def _span(numbers: set) -> str:
    ordered = sorted(numbers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    return ", ".join(map(str, ordered[:8])) + (", ..." if len(ordered) > 8 else "")


def _parse_rope(hf: dict, path) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; checkpoints on the Hub carry rope_theta + rope_scaling.
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError(path, "config rope_parameters / rope_scaling must be objects")
    params = dict(params)
    said = params.get("rope_type"), scaling.get("rope_type") or scaling.get("type")
    if all(said) and said[0] != said[1]:  # which one transformers would follow depends on its version: refuse
        raise UnsupportedModelError(path, f"config rope_parameters says rope_type {said[0]!r} but rope_scaling says "
                                          f"{said[1]!r}")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if params.get("rope_type") else scaling

    def number(key, where=None):
        where = source if where is None else where
        if key not in where:
            raise UnsupportedModelError(path, f"rope scaling {kind!r} without {key!r}")
        value = where[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise CheckpointError(path, f"config rope {key} must be a positive number, got {_show(value)}")
        return value

    theta = number("rope_theta", params if "rope_theta" in params else {"rope_theta": hf.get("rope_theta", 10000.0)})
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=number("factor"))
    if kind == "yarn":
        return _parse_yarn(hf, source, theta, number, path)
    if kind == "llama3":
        if number("high_freq_factor") <= number("low_freq_factor"):  # they divide by the difference
            raise CheckpointError(path, "config rope high_freq_factor must be larger than low_freq_factor")
        return RopeConfig(
            theta=theta, kind="llama3", factor=number("factor"),
            low_freq_factor=number("low_freq_factor"), high_freq_factor=number("high_freq_factor"),
            original_max_position_embeddings=number("original_max_position_embeddings"),
        )
    raise UnsupportedModelError(path, f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, "
                                      f"yarn)")


def _parse_yarn(hf: dict, source: dict, theta: float, number, path) -> RopeConfig:
    """YaRN's parameters with transformers' defaults; attention_factor as it computes it when not given."""
    factor = number("factor")
    original = number("original_max_position_embeddings")

    def optional(key, default):
        return number(key) if source.get(key) is not None else default

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = source.get("attention_factor")
    if attention is not None:
        attention = number("attention_factor")
    elif source.get("mscale") and source.get("mscale_all_dim"):
        attention = mscale(factor, number("mscale")) / mscale(factor, number("mscale_all_dim"))
    else:
        attention = mscale(factor)
    truncate = source.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(path, f"config rope truncate must be true or false, got {_show(truncate)}")
    return RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=optional("beta_fast", 32.0), beta_slow=optional("beta_slow", 1.0), truncate=truncate,
                      attention_factor=attention)


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
        rules.append((block + re.escape(arch.router_name) + r"\.(weight|bias)", r"layers.\1.moe.router.\2"))
        for ours, theirs in zip(("gate", "up", "down"), arch.expert_proj):
            rules.append((block + r"experts\.(\d+)\." + theirs + r"\.weight", rf"layers.\1.moe.experts.\2.{ours}.weight"))
    if arch.latent_attention:
        for theirs, ours in (("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_a_proj_with_mqa", "wkv_a"),
                             ("kv_b_proj", "wkv_b"), ("q_a_layernorm", "q_a_norm"), ("kv_a_layernorm", "kv_a_norm")):
            rules.append((_LAYER + r"self_attn\." + theirs + r"\.(weight|bias)", rf"layers.\1.attn.{ours}.\2"))
    if arch.model_type == "gpt_oss":
        rules.append((_LAYER + r"self_attn\.sinks", r"layers.\1.attn.sinks"))
        rules.append((block + r"experts\.(gate_up|down)_proj_bias", r"layers.\1.moe.\2_bias"))
    if arch.router == "sigmoid":
        rules.append((block + re.escape(arch.score_bias_name), r"layers.\1.moe.score_bias"))
    if arch.delta_net:
        linear = _LAYER + r"linear_attn\."
        for theirs, ours in ((r"in_proj_(qkv|z|b|a)\.weight", r"in_\2.weight"), (r"conv1d\.weight", "conv"),
                             (r"(A_log|dt_bias)", r"\2"), (r"norm\.weight", "norm.weight"),
                             (r"out_proj\.weight", "out.weight")):
            rules.append((linear + theirs, r"layers.\1.attn." + ours))
    if arch.shared_expert:
        shared = re.escape(arch.shared_expert_name)
        rules.append((_LAYER + r"mlp\." + shared + r"\.(gate|up|down)_proj\.weight", r"layers.\1.moe.shared.\2.weight"))
        rules.append((_LAYER + r"mlp\.shared_expert_gate\.weight", r"layers.\1.moe.shared_gate.weight"))
    return [(re.compile(pattern + "$"), target) for pattern, target in rules]


def is_ignored_tensor(name: str, cfg: ModelConfig | None = None) -> bool:
    """Tensors some checkpoints carry that hold nothing the forward pass needs: RoPE tables, and the layers of
    multi-token prediction (GLM-4.x, DeepSeek-V3: after the last layer; Qwen3-Next: under mtp.; moedesk does not run
    them)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if cfg is not None and cfg.is_recurrent and name.startswith("mtp."):  # Qwen3-Next's multi-token prediction
        return True
    if cfg is not None and cfg.mtp_layers and (m := _LAYER_NUMBER.match(name)):
        return int(m.group(1)) >= cfg.num_layers
    return False


def map_weight_name(rules, name: str) -> str | None:
    """Our name for a checkpoint tensor, or None when no rule knows it."""
    for pattern, target in rules:
        m = pattern.match(name)
        if m:
            return m.expand(target)
    return None
