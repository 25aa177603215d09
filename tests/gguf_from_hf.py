"""Tiny GGUFs of 2026's MoE families (gpt-oss, Qwen3.5-MoE, Qwen3-Next, GLM-4.x-MoE, GLM-4.7-Flash, DeepSeek-V3,
MiniMax-M2, LFM2-MoE), written from tiny random transformers checkpoints with the gguf package: the test side of llama.cpp's
convert_hf_to_gguf.py.

`build(family, folder)` saves a transformers checkpoint (its Hub layout: one tensor per expert) and writes
`model.gguf` beside it from those files, as llama.cpp's converter would: the family's metadata keys, gguf's
TensorNameMap for names, and the converter's per-family rewrites (gpt-oss's interleaved gate/up split,
Qwen3.5's A_log / conv / zero-centred norms and V-head order, Qwen3-Next's qkvz split, DeepSeek's kv_b split,
experts stacked).
Weights stay float32, so llama.cpp computes with what transformers computes with.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from tests.tiny_models import COMMON, SPECIAL, CHAT_TEMPLATE, train_tokenizer

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Family:
    gguf_arch: str  # the name llama.cpp knows the architecture by (general.architecture)
    config_class: str
    model_class: str
    config: dict
    metadata: Callable  # (writer, hf config dict) -> None: the family's own keys, beyond _common_metadata
    tensors: Callable  # (hf config dict, Hub tensors) -> (Hub-style name, tensor) pairs for TensorNameMap
    # (model, seed) -> {Hub name: tensor or None (dropped)}: what the saved checkpoint holds instead, e.g. experts
    # packed as the released checkpoints pack them; the model's own weights are set to what the file holds
    repack: Callable | None = None


# --- per-family rewrites ---------------------------------------------------------------------------------

EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward)\.experts)\.(\d+)\.(\w+)\.weight")


def _stack_experts(tensors: Tensors) -> Tensors:
    """The Hub keeps one tensor per expert; a GGUF keeps a layer's experts as one [experts, out, in] tensor."""
    out, per_layer = {}, {}
    for name, t in tensors.items():
        if m := EXPERT.fullmatch(name):
            per_layer.setdefault((m[1], m[3]), {})[int(m[2])] = t
        else:
            out[name] = t
    for (module, proj), experts in per_layer.items():
        out[f"{module}.{proj}.weight"] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _renamed_correction_bias(tensors: Tensors) -> Tensors:
    return {name.replace("e_score_correction_bias", "e_score_correction.bias"): t for name, t in tensors.items()}


def mxfp4_to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as the Hub's gpt-oss checkpoints pack it (blocks [..., G, 16]: weight 2i in byte i's low nibble, 2i + 1
    in its high one; scales [..., G]: E8M0 exponents) -> GGUF's MXFP4 rows [..., G * 17]: per block the exponent,
    then 16 bytes holding weight j in the low nibble and weight j + 16 in the high one."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32] in weight order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


def _gpt_oss_mxfp4_experts(model, seed: int) -> dict:
    """Random MXFP4 experts in the released checkpoints' layout (gate_up_proj_blocks [E, 2F, H/32, 16], rows
    interleaving gate and up; down_proj_blocks [E, H, F/32, 16]); the model computes with their values, as
    transformers computes with such a checkpoint it dequantizes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed + 2)
    out = {}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        prefix = f"model.layers.{i}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            e, k, rows = getattr(experts, proj).shape  # the float parameter is [experts, in, out]
            blocks = torch.randint(0, 256, (e, rows, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 124, (e, rows, k // 32), generator=g, dtype=torch.uint8)  # 2^-7..2^-4
            with torch.no_grad():
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            out.update({prefix + proj: None, prefix + proj + "_blocks": blocks, prefix + proj + "_scales": scales})
    return out


def _gpt_oss_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors.items():
        if name.endswith("_scales"):
            continue  # with its blocks
        if name.endswith("experts.gate_up_proj_blocks"):  # MXFP4, kept packed (uint8 rows)
            base = name.removesuffix("gate_up_proj_blocks")
            scales = tensors[name.removesuffix("_blocks") + "_scales"]
            yield base + "gate_proj.weight", mxfp4_to_gguf(t[:, ::2], scales[:, ::2])
            yield base + "up_proj.weight", mxfp4_to_gguf(t[:, 1::2], scales[:, 1::2])
        elif name.endswith("experts.down_proj_blocks"):
            base = name.removesuffix("_blocks")
            yield base + ".weight", mxfp4_to_gguf(t, tensors[base + "_scales"])
        elif name.endswith(".sinks"):
            yield name + ".weight", t
        elif name.endswith("experts.gate_up_proj"):
            # [experts, hidden, 2 * ff] with gate and up interleaved column by column
            t = t.transpose(-1, -2)
            base = name.removesuffix("gate_up_proj")
            yield base + "gate_proj.weight", t[:, ::2, :]
            yield base + "up_proj.weight", t[:, 1::2, :]
        elif name.endswith("experts.gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            yield base + "gate_proj.bias", t[..., ::2]
            yield base + "up_proj.bias", t[..., 1::2]
        elif name.endswith("experts.down_proj"):
            yield name + ".weight", t.transpose(-1, -2)
        elif name.endswith("experts.down_proj_bias"):
            yield name.removesuffix("_bias") + ".bias", t
        else:
            yield name, t


def _gpt_oss_metadata(w, cfg: dict) -> None:
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def _reorder_v_heads(t: torch.Tensor, dim: int, k_heads: int, v_per_k: int, head_dim: int) -> torch.Tensor:
    """Qwen3.5 groups V heads by their K head (k0v0 k0v1 k1v0 k1v1); llama.cpp broadcasts K heads tiled
    (k0v0 k1v0 k0v1 k1v1), so the converter reorders every tensor indexed by V head."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, v_per_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen35_moe_tensors(cfg: dict, tensors: Tensors, tiled_v_heads: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, per_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], v_heads // k_heads
    key_dim = k_heads * dk

    def by_v_head(t, dim, head_dim):
        return _reorder_v_heads(t, dim, k_heads, per_k, head_dim) if per_k > 1 and tiled_v_heads else t

    for name, t in _stack_experts(tensors).items():
        if name.endswith(".A_log"):
            t = -torch.exp(by_v_head(t, 0, 1))  # llama.cpp keeps A itself
        elif name.endswith(".dt_bias"):
            name, t = name.removesuffix("dt_bias") + "dt_proj.bias", by_v_head(t, 0, 1)
        elif name.endswith("conv1d.weight"):
            t = t.squeeze(1)  # [channels, 1, kernel] -> [channels, kernel]; channels are q, k, then v
            t = torch.cat([t[:2 * key_dim], by_v_head(t[2 * key_dim:], 0, dv)])
        elif name.endswith("in_proj_qkv.weight"):
            t = torch.cat([t[:2 * key_dim], by_v_head(t[2 * key_dim:], 0, dv)])
        elif name.endswith("in_proj_z.weight"):
            t = by_v_head(t, 0, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            t = by_v_head(t, 0, 1)
        elif name.endswith("linear_attn.out_proj.weight"):
            t = by_v_head(t, 1, dv)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1  # transformers' norms here scale by (1 + weight); llama.cpp's by weight
        elif name.endswith("shared_expert_gate.weight"):
            t = t.squeeze(0)
        yield name, t


def _qwen3_next_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next fuses q, k, v and the output gate z per K head in in_proj_qkvz; llama.cpp wants every head's
    q, then k, then v in one tensor and z in another (and keeps in_proj_ba, and V heads, in the Hub's order)."""
    k_heads, per_k = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    parts = [dk, dk, per_k * dv, per_k * dv]
    split = {}
    for name, t in tensors.items():
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = (p.reshape(-1, t.shape[-1]) for p in t.reshape(k_heads, sum(parts), -1).split(parts, 1))
            base = name.removesuffix("in_proj_qkvz.weight")
            split[base + "in_proj_qkv.weight"], split[base + "in_proj_z.weight"] = torch.cat([q, k, v]), z
        else:
            split[name] = t
    yield from _qwen35_moe_tensors(cfg, split, tiled_v_heads=False)


def _qwen35_moe_metadata(w, cfg: dict, mrope: bool = True) -> None:
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    rope_dims = int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(rope_dims)
    if mrope:
        # Interleaved multimodal RoPE (pair i in section t, h, w as i % 3): text carries one position in the
        # t, h and w sections, so RoPE on text is plain RoPE as long as no pair falls past them (llama.cpp's
        # fourth section, which rotates text by position 0). Qwen3.5's own [11, 11, 10] at this size:
        pairs = rope_dims // 2
        w.add_rope_dimension_sections([(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    # This gguf has no per-layer recurrent key: llama.cpp then takes every 4th layer as full attention.
    assert cfg["layer_types"] == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                  for i in range(cfg["num_hidden_layers"])]
    w.add_full_attention_interval(4)


def _routed_metadata(w, cfg: dict) -> None:
    """Sigmoid-scored, group-limited routing with a correction bias: GLM-4.x and DeepSeek-V3."""
    import gguf

    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])


def _qwen3_moe_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _stack_experts(tensors).items()


def _qwen3_moe_metadata(w, cfg: dict) -> None:
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))  # transformers 5 saves the latter
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _glm4_moe_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _renamed_correction_bias(_stack_experts(tensors)).items()


def _glm4_moe_metadata(w, cfg: dict) -> None:
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    _routed_metadata(w, cfg)


def _deepseek_v3_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in _renamed_correction_bias(_stack_experts(tensors)).items():
        if name.endswith("kv_b_proj.weight"):
            # MLA's absorbed form: llama.cpp wants kv_b split per head into K's part (transposed) and V's part
            kv_b = t.reshape(heads, nope + v, t.shape[-1])
            yield name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:]
        else:
            yield name, t


def _deepseek_v3_metadata(w, cfg: dict) -> None:
    kv_lora, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(rope_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    # MLA as llama.cpp runs it: one shared latent "head" of kv_lora + rope dims, decompressed per head
    w.add_key_length(kv_lora + rope_dim)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(cfg["v_head_dim"])
    _routed_metadata(w, cfg)


def _glm4_moe_lite_metadata(w, cfg: dict) -> None:
    """GLM-4.7-Flash, which llama.cpp's converter writes as deepseek2 (its Glm4MoeLiteModel): DeepSeek-V3's keys, the
    dense first layers counted from the config's mlp_layer_types where transformers keeps them."""
    types = cfg.get("mlp_layer_types") or []
    dense = cfg.get("first_k_dense_replace")
    if dense is None:
        dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    _deepseek_v3_metadata(w, {**cfg, "first_k_dense_replace": dense})


def _minimax_m2_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _renamed_correction_bias(_stack_experts(tensors)).items()


def _minimax_m2_metadata(w, cfg: dict) -> None:
    import gguf

    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _lfm2_moe_tensors(cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in _stack_experts(tensors).items():
        if name.endswith(".expert_bias"):
            name += ".bias"
        elif name.endswith("conv.conv.weight"):
            t = t.squeeze(1)  # [channels, 1, L] -> [channels, L]
        elif ".experts." in name:
            name = name.removeprefix("model.")  # where gguf's name map looks for LFM2's stacked experts
        yield name, t


def _lfm2_moe_metadata(w, cfg: dict) -> None:
    import gguf

    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_leading_dense_block_count(cfg["num_dense_layers"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_shortconv_l_cache(cfg["conv_L_cache"])


MOE_COMMON = dict(COMMON, num_hidden_layers=4, num_key_value_heads=2)

FAMILIES = {
    "gpt-oss": Family(
        "gpt-oss", "GptOssConfig", "GptOssForCausalLM",
        # The real models' YaRN rope (factor 32 over 4096 positions) and alternating sliding/full layers, with a
        # window shorter than the prompts so the sliding layers really slide.
        dict(MOE_COMMON, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=8, max_position_embeddings=131072),
        _gpt_oss_metadata, _gpt_oss_tensors),
    "gpt-oss-mxfp4": Family(
        "gpt-oss", "GptOssConfig", "GptOssForCausalLM",
        # The same with the experts in MXFP4 as openai/gpt-oss-* ship them, kept packed in the GGUF.
        dict(MOE_COMMON, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=8, max_position_embeddings=131072),
        _gpt_oss_metadata, _gpt_oss_tensors, _gpt_oss_mxfp4_experts),
    "qwen35moe": Family(
        "qwen35moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        # Three Gated DeltaNet layers then a gated full-attention layer; twice as many V heads as K heads.
        dict(MOE_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
        _qwen35_moe_metadata, _qwen35_moe_tensors),
    "qwen3next": Family(
        "qwen3next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
        # Qwen3.5's layer pattern in Qwen3-Next's older layout: fused in_proj_qkvz and in_proj_ba, plain RoPE.
        dict(MOE_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
        lambda w, cfg: _qwen35_moe_metadata(w, cfg, mrope=False), _qwen3_next_tensors),
    "qwen3moe": Family(
        "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        # Qwen3-MoE, which the native engine runs too: q/k norms, normalised top-k routing; its templates think.
        dict(MOE_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True),
        _qwen3_moe_metadata, _qwen3_moe_tensors),
    "glm4moe": Family(
        "glm4moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
        # GLM-4.5's shape: a dense first layer, q/k norms and biases, partial rotary, grouped sigmoid routing.
        dict(MOE_COMMON, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0),
        _glm4_moe_metadata, _glm4_moe_tensors),
    "deepseek2": Family(
        "deepseek2", "DeepseekV3Config", "DeepseekV3ForCausalLM",
        # DeepSeek-V3's MLA (q and kv low-rank, a rope part shared by the heads), a dense first layer and
        # grouped sigmoid routing with a correction bias.
        dict(MOE_COMMON, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
             norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, num_nextn_predict_layers=0),
        _deepseek_v3_metadata, _deepseek_v3_tensors),
    "glm4-moe-lite": Family(
        "deepseek2", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
        # GLM-4.7-Flash: DeepSeek-V3's MLA and routing under GLM's names, its dense layers in mlp_layer_types.
        dict(MOE_COMMON, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.8, kv_lora_rank=32, q_lora_rank=48,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
        _glm4_moe_lite_metadata, _deepseek_v3_tensors),
    "minimax-m2": Family(
        "minimax-m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
        # MiniMax-M2's shape: q/k norms over all heads at once, half of each head rotated, sigmoid routing
        # with a correction bias.
        dict(MOE_COMMON, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
             rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}),
        _minimax_m2_metadata, _minimax_m2_tensors),
    "lfm2moe": Family(
        "lfm2moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
        # LFM2-MoE's shape: gated short-convolution layers between attention layers, a dense first layer,
        # sigmoid routing with an expert bias, tied embeddings.
        dict(MOE_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1,
             layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True),
        _lfm2_moe_metadata, _lfm2_moe_tensors),
}


# --- the writer --------------------------------------------------------------------------------------------

def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give every constant-initialised tensor (norms, biases, sinks, correction biases...) random values, so
    a tensor the writer mislays changes the output instead of hiding behind a zero or a one."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and torch.all(p == p.flatten()[0]):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _common_metadata(w, cfg: dict, n_layers: int) -> None:
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    kv_heads = cfg["num_key_value_heads"] if "kv_lora_rank" not in cfg else 1  # MLA: one shared latent head
    if "conv_L_cache" in cfg:  # LFM2: per layer, none in the short-convolution layers
        kv_heads = [kv_heads if t == "full_attention" else 0 for t in cfg["layer_types"]]
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or cfg["norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(0)  # all float32


def _tokenizer_metadata(w, folder: Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """The byte-level BPE as llama.cpp's "gpt2" tokenizer: tokens, merges, special ids, chat template (None:
    none)."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: tok for tok, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if t in SPECIAL else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex: what tokenizers' ByteLevel pre-tokenizer applies
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(COMMON["bos_token_id"])
    w.add_eos_token_id(SPECIAL.index("<|im_end|>"))
    w.add_pad_token_id(COMMON["pad_token_id"])
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def model_metadata(w, family: str, cfg: dict) -> None:
    """Every key but the tokenizer's, for the transformers config dict cfg."""
    _common_metadata(w, cfg, cfg["num_hidden_layers"])
    FAMILIES[family].metadata(w, cfg)


def gguf_tensors(family: str, cfg: dict, tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in GGUF's layout) for every Hub tensor of the checkpoint (meta tensors work too)."""
    import gguf

    fam = FAMILIES[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == fam.gguf_arch)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for name, t in fam.tensors(cfg, tensors):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{family}: no GGUF name for {name}")
        yield gguf_name, t


def write_gguf(family: str, folder: Path, out: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Convert the transformers checkpoint in folder (config.json, model.safetensors, tokenizer.json) to out."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), FAMILIES[family].gguf_arch)
    w.add_name(f"tiny-random-{family}")
    model_metadata(w, family, cfg)
    _tokenizer_metadata(w, folder, cfg["vocab_size"], chat_template)
    for name, t in gguf_tensors(family, cfg, load_file(folder / "model.safetensors")):
        if t.dtype == torch.uint8:  # packed MXFP4 rows (mxfp4_to_gguf)
            w.add_tensor(name, t.contiguous().numpy(), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, t.to(torch.float32).contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


class Built(NamedTuple):
    folder: Path  # the transformers checkpoint: config.json, model.safetensors, tokenizer.json
    gguf: Path
    model: torch.nn.Module  # the transformers model those files hold, in float32, in eval mode


def build(family: str, folder: Path, seed: int = 0) -> Built:
    """A tiny random transformers checkpoint of `family` (a key of FAMILIES) in folder, and its GGUF beside it."""
    import transformers

    fam = FAMILIES[family]
    config = getattr(transformers, fam.config_class)(**fam.config)
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(config).eval()
    _perturb(model, seed)
    repacked = fam.repack(model, seed) if fam.repack else {}
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if repacked:
        from safetensors.torch import load_file, save_file

        saved = {**load_file(folder / "model.safetensors"), **repacked}
        save_file({name: t.contiguous() for name, t in saved.items() if t is not None}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    tok = train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
    }))
    return Built(folder, write_gguf(family, folder, folder / "model.gguf"), model)
