"""The released config.json of each 2026 family, parsed: every field that changes the computation read as the
reference reads it. The dicts are configs, so they are data here: the keys of the published files (Hugging Face:
openai/gpt-oss-20b, deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, zai-org/GLM-4.7-Flash,
Qwen/Qwen3-Next-80B-A3B-Instruct, Qwen/Qwen3.5-35B-A3B, MiniMaxAI/MiniMax-M2) with their values, as public
transcriptions of those files give them. Left out: quantization_config where one is published (FP8 for DeepSeek-V3,
Kimi-K2 and MiniMax-M2, which the checkpoint refuses before the config is parsed; gpt-oss's MXFP4 is
tests/model/test_families.py's), most of Qwen3.5's vision_config, and MiniMax-M2's multi-token prediction keys. Long
lists (Qwen's layer_types) are written as the pattern they hold.

What these found: GLM-4.7-Flash (2048 hidden, 20 heads) was refused for a hidden size not a multiple of its heads,
which MLA never divides; Kimi-K2's model_type was refused."""
from __future__ import annotations

import math

import pytest

from moedesk.engine.errors import UnsupportedModelError
from moedesk.engine.model.architectures import parse_config, reads_images

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# Kimi-K2 is DeepSeek-V3's architecture under its own model_type ("kimi_k2", so that engines can tell them apart).
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840,
}

GLM_4_7_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10240, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "model_type": "glm4_moe_lite", "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 20, "num_experts_per_tok": 4,
    "num_hidden_layers": 47, "num_key_value_heads": 20, "num_nextn_predict_layers": 1, "pad_token_id": 154820,
    "partial_rotary_factor": 1.0, "q_lora_rank": 768, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.8,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 256,
    "vocab_size": 154880,
}

QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
        "use_cache": True, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe", "out_hidden_size": 2048},
    "vision_end_token_id": 248054, "vision_start_token_id": 248053,
}

MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
}


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 0.1 * m * math.log(factor) + 1.0


def test_gpt_oss_20b():
    cfg = parse_config(GPT_OSS_20B)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gpt_oss", 24, 2880, 64, 8, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.moe_layers == (True,) * 24 and cfg.router == "topk_softmax" and cfg.router_bias and cfg.expert_bias
    assert cfg.sliding_window == 128 and cfg.sliding_layers == (True, False) * 12
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias and cfg.norm_weight_first
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    rope = cfg.rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings) == ("yarn", 150000, 32.0, 4096)
    assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (32.0, 1.0, False)
    assert rope.attention_factor == pytest.approx(yarn_mscale(32.0))
    assert (cfg.vocab_size, cfg.eos_token_ids, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        201088, (200002,), 1e-5, False)
    assert cfg.max_position_embeddings == 131072


@pytest.mark.parametrize("hf", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek-v3", "kimi-k2"])
def test_deepseek_v3_and_kimi_k2(hf):
    cfg = parse_config(hf)
    dense = hf["first_k_dense_replace"]
    assert cfg.arch == "deepseek_v3"  # Kimi-K2's own model_type names DeepSeek-V3's architecture
    assert cfg.num_layers == 61 and cfg.mtp_layers == hf["num_nextn_predict_layers"]
    assert cfg.moe_layers == (False,) * dense + (True,) * (61 - dense)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == (
        hf["n_routed_experts"], 8, 2048, 18432)
    assert (cfg.router, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == (
        "sigmoid", hf["n_group"], hf["topk_group"], True)
    assert cfg.routed_scaling_factor == hf["routed_scaling_factor"]
    assert cfg.shared_expert_intermediate_size == 2048 and not cfg.shared_expert_gate
    heads = hf["num_attention_heads"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.kv_lora_rank, cfg.q_lora_rank) == (heads, heads, 512, 1536)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.rope_dims, cfg.v_head_dim) == (192, 64, 64, 128)
    assert cfg.rope_interleave
    scaling = hf["rope_scaling"]
    rope = cfg.rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "yarn", hf["rope_theta"], scaling["factor"], 4096)
    assert (rope.beta_fast, rope.beta_slow) == (scaling["beta_fast"], scaling["beta_slow"])
    assert rope.attention_factor == pytest.approx(1.0)  # mscale == mscale_all_dim: the tables stay unscaled...
    # ...and the softmax scale takes yarn's mscale squared (DeepSeek's softmax_scale)
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * yarn_mscale(scaling["factor"]) ** 2)
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids) == (
        hf["vocab_size"], hf["bos_token_id"], (hf["eos_token_id"],))
    assert cfg.max_position_embeddings == hf["max_position_embeddings"] and not cfg.tie_word_embeddings


def test_glm_4_7_flash():
    cfg = parse_config(GLM_4_7_FLASH)
    assert (cfg.arch, cfg.num_layers, cfg.mtp_layers, cfg.hidden_size) == ("glm4_moe_lite", 47, 1, 2048)
    assert cfg.moe_layers == (False,) + (True,) * 46
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == (
        64, 4, 1536, 10240)
    assert (cfg.router, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (
        "sigmoid", 1, 1, 1.8, True)
    assert cfg.shared_expert_intermediate_size == 1536 and not cfg.shared_expert_gate
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.kv_lora_rank, cfg.q_lora_rank) == (20, 20, 512, 768)
    assert (cfg.head_dim, cfg.rope_dims, cfg.v_head_dim, cfg.rope_interleave) == (256, 64, 256, True)
    assert cfg.rope.kind == "default" and cfg.rope.theta == 1000000 and cfg.attention_scale == pytest.approx(256 ** -0.5)
    assert cfg.eos_token_ids == (154820, 154827, 154829) and cfg.rms_norm_eps == 1e-5
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (154880, 202752)


def check_qwen_delta_net(cfg, layers, experts, top_k):
    assert cfg.linear_layers == (True, True, True, False) * (layers // 4)
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == (
        16, 32, 128, 128)
    assert cfg.linear_conv_kernel == 4 and cfg.attention_gate and cfg.norm_offset
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dims, cfg.qk_norm) == (16, 2, 256, 64, "head")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (experts, top_k, 512)
    assert cfg.moe_layers == (True,) * layers and cfg.norm_topk_prob and cfg.router == "softmax"
    assert cfg.shared_expert_intermediate_size == 512 and cfg.shared_expert_gate
    assert cfg.rope.kind == "default" and cfg.rope.theta == 10000000
    assert (cfg.hidden_size, cfg.max_position_embeddings, cfg.rms_norm_eps) == (2048, 262144, 1e-6)
    assert not cfg.tie_word_embeddings


def test_qwen3_next_80b_a3b():
    cfg = parse_config(QWEN3_NEXT_80B)
    assert cfg.arch == "qwen3_next" and cfg.num_layers == 48
    check_qwen_delta_net(cfg, 48, 512, 10)
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids) == (151936, 151643, (151645,))


def test_qwen3_5_35b_a3b_reads_its_text_model():
    cfg = parse_config(QWEN3_5_35B_A3B)
    assert cfg.arch == "qwen3_5_moe" and cfg.num_layers == 40 and reads_images(QWEN3_5_35B_A3B)
    check_qwen_delta_net(cfg, 40, 256, 8)
    assert (cfg.vocab_size, cfg.eos_token_ids) == (248320, (248044,))
    assert cfg.mtp_layers == 0  # its MTP layer lives under mtp., which the loader leaves out


def test_a_qwen3_5_config_without_the_attention_output_gate_is_refused():
    text = {**QWEN3_5_35B_A3B["text_config"], "attn_output_gate": False}
    with pytest.raises(UnsupportedModelError, match="attn_output_gate"):
        parse_config({**QWEN3_5_35B_A3B, "text_config": text})


def test_minimax_m2():
    cfg = parse_config(MINIMAX_M2)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "minimax_m2", 62, 3072, 48, 8, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 1536)
    assert cfg.moe_layers == (True,) * 62 and cfg.shared_expert_intermediate_size == 0
    assert (cfg.router, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (
        "sigmoid", 1, 1, 1.0, True)
    assert cfg.qk_norm == "full" and cfg.rope_dims == 64 and cfg.rotary_dim == 64  # rotary_dim: half of each head
    assert cfg.rope.kind == "default" and cfg.rope.theta == 5000000 and not cfg.attention_bias
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        200064, 196608, 1e-6, False)


@pytest.mark.parametrize("extra", [{}, {"rotary_dim": 32}, {"partial_rotary_factor": 0.25},
                                   {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                        "partial_rotary_factor": 0.75}}],
                         ids=["released", "rotary-dim", "factor", "rope-parameters"])
def test_minimax_m2_rotary_width_is_transformers(extra):
    """How many of each head's dims RoPE turns, from the released rotary_dim or the newer keys, as transformers'
    config class derives it from the same file (built on the meta device: nothing is allocated)."""
    import torch
    import transformers
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    says_factor = "partial_rotary_factor" in {**extra, **extra.get("rope_parameters", {})}
    if not says_factor and "partial_rotary_factor" not in transformers.MiniMaxM2Config(rotary_dim=64).rope_parameters:
        pytest.skip(f"transformers {transformers.__version__} turns the whole head where a config says rotary_dim "
                    f"alone (huggingface/transformers#48241): no reference for the released key")
    hf = {**MINIMAX_M2, **extra}
    theirs = transformers.MiniMaxM2Config(**{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        rotary = MiniMaxM2RotaryEmbedding(theirs)
    assert parse_config(hf).rope_dims == 2 * rotary.inv_freq.shape[0]


@pytest.mark.parametrize("key, value", [("scoring_func", "softmax"), ("use_routing_bias", False),
                                        ("qk_norm_type", "per_head"), ("shared_intermediate_size", 1024)])
def test_a_minimax_m2_config_transformers_would_not_run_as_written_is_refused_in_one_line(key, value):
    with pytest.raises(UnsupportedModelError, match=f"unsupported config field {key}=") as refused:
        parse_config({**MINIMAX_M2, key: value})
    assert "\n" not in str(refused.value)


def test_a_kimi_k2_checkpoint_loads_as_the_deepseek_v3_it_is(tiny_checkpoint, tmp_path):
    """Moonshot's note on Kimi-K2: its config.json says model_type kimi_k2 for DeepSeek-V3's architecture, and
    renaming it deepseek_v3 runs it. moedesk reads it so without the renaming: the same logits."""
    import json
    import shutil

    import torch

    from moedesk.engine.runtime import Engine

    folder = tiny_checkpoint("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(folder, kimi)
    config = json.loads((folder / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    ids = list(range(3, 20))
    logits = []
    for path in (folder, kimi):
        engine = Engine.load(str(path), device="cpu", dtype="float32")
        assert engine.config.arch == "deepseek_v3"
        cache = engine.model.new_cache(1, len(ids), torch.float32, "cpu")
        logits.append(engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, engine.executor)[0])
    assert torch.equal(*logits)
    from moedesk.app.tui.catalog import folder_model

    assert folder_model(kimi, "folder").supported  # the Models screen lists it as one the native engine runs


def kimi_k25_folder(deepseek, out):
    """A Kimi-K2.5 checkpoint as Moonshot lays it out, around the tiny DeepSeek-V3 in `deepseek`: config.json of
    model_type kimi_k25 nesting the text model's (model_type kimi_k2) and a vision tower's, the text model's tensors
    under language_model.model. and language_model.lm_head., the vision tower and its projector beside them."""
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(deepseek, out)
    text = json.loads((deepseek / "config.json").read_text())
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": {**text, "model_type": "kimi_k2"}, "media_placeholder_token_id": 163605,
              "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 32,
                                "num_hidden_layers": 1}, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(deepseek / "model.safetensors"), "pt") as f:
        tensors = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): f.get_tensor(k)
                   for k in f.keys()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(96, 32)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 128)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_kimi_k25_parses_as_the_deepseek_v3_text_model_it_nests():
    """Kimi-K2.5 is Kimi-K2's text model (DeepSeek-V3's architecture) with a vision tower: its config nests the text
    model's; here Kimi-K2's, as transformers' Kimi_K25Config nests it (model_type kimi_k2 read as deepseek_v3)."""
    import transformers

    hf = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
          "text_config": KIMI_K2, "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14}}
    cfg = parse_config(hf)
    assert cfg == parse_config(KIMI_K2) and reads_images(hf)
    theirs = transformers.Kimi_K25Config(text_config={k: v for k, v in KIMI_K2.items() if k != "auto_map"})
    assert theirs.text_config.model_type == "deepseek_v3" and theirs.text_config.n_routed_experts == cfg.num_experts


def test_a_kimi_k25_checkpoint_runs_its_text_model_and_says_images_are_not(tiny_checkpoint, tmp_path):
    """The text model's tensors under Moonshot's names load as DeepSeek-V3 and give transformers' tokens (its
    DeepseekV3 on the same weights: what Kimi_K25ForConditionalGeneration runs on text); the vision tower is not
    loaded, with one warning saying so; the size estimate counts the text model alone; the Models screen lists it.
    Its routed experts in INT4 as the release has them (compressed-tensors, Moonshot's ignore list under its own
    names) load too, and give transformers' tokens on the dequantised weights."""
    from moedesk.app.tui.catalog import folder_model
    from moedesk.engine.load.size_estimate import summarize_path
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine
    from tests.load.test_compressed_tensors import kimi_k2
    from tests.reference import hf_greedy, hf_model

    deepseek = tiny_checkpoint("deepseek_v3")
    kimi = kimi_k25_folder(deepseek, tmp_path / "kimi-k2.5")
    engine = Engine.load(str(kimi), device="cpu", dtype="float32")
    assert engine.config.arch == "deepseek_v3" and any("images are not supported" in w for w in engine.warnings)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    done = engine.complete([Request(prompt, SamplingParams(max_new_tokens=12, temperature=0))])
    assert done[0].token_ids == hf_greedy(hf_model(deepseek), prompt, 12, eos)
    assert summarize_path(kimi).estimate("auto", "float32") == summarize_path(deepseek).estimate("auto", "float32")
    assert folder_model(kimi, "folder").supported

    int4, dequantised, _ = kimi_k2(deepseek, tmp_path / "kimi-k2-int4")
    quantised = kimi_k25_folder(int4, tmp_path / "kimi-k2.5-int4")
    engine = Engine.load(str(quantised), device="cpu", dtype="float32")
    assert {m.experts.gate_up_format for m in engine.model.moe_blocks()} == {"q4_0"}
    done = engine.complete([Request(prompt, SamplingParams(max_new_tokens=12, temperature=0))])
    assert done[0].token_ids == hf_greedy(hf_model(dequantised), prompt, 12, eos)
    assert folder_model(quantised, "folder").supported


def test_mla_with_heads_that_do_not_divide_the_hidden_size_runs_as_transformers(tmp_path):
    """GLM-4.7-Flash's 20 heads do not divide its 2048 hidden size, which MLA never needs: a tiny glm4_moe_lite of 5
    heads over 64 loads and gives transformers' greedy tokens."""
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine
    from tests import tiny_models
    from tests.reference import hf_greedy, hf_model

    folder = tiny_models.build("glm4_moe_lite", tmp_path / "glm", num_attention_heads=5, num_key_value_heads=5)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    assert (engine.config.hidden_size, engine.config.num_heads) == (64, 5)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    done = engine.complete([Request(prompt, SamplingParams(max_new_tokens=12, temperature=0))])
    assert done[0].token_ids == hf_greedy(hf_model(folder), prompt, 12, eos)


@pytest.mark.parametrize("hf, config_class", [(GPT_OSS_20B, "GptOssConfig"), (DEEPSEEK_V3, "DeepseekV3Config"),
                                              (KIMI_K2, "DeepseekV3Config")], ids=["gpt-oss-20b", "deepseek-v3", "kimi-k2"])
def test_the_yarn_rope_of_each_release_is_transformers(hf, config_class):
    """Their rope scaling (gpt-oss's untruncated, DeepSeek's with mscale, Kimi-K2's with beta_fast = beta_slow) gives
    transformers' own frequencies and attention factor, from the same config."""
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moedesk.engine.model.transformer import rope_inv_freq

    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k not in ("model_type", "auto_map")})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    cfg = parse_config(hf)
    assert torch.equal(rope_inv_freq(cfg.rope, cfg.rope_dims), inv_freq)
    assert cfg.rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("hf, config_class, attention", [
    (DEEPSEEK_V3, "DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention"),
    (KIMI_K2, "DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention"),
    (GLM_4_7_FLASH, "Glm4MoeLiteConfig", "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention")],
    ids=["deepseek-v3", "kimi-k2", "glm-4.7-flash"])
def test_the_latent_attentions_softmax_scale_is_transformers(hf, config_class, attention):
    """MLA's softmax scale (yarn's mscale squared where mscale_all_dim is set) as transformers' attention module
    computes it from the same config (built on the meta device: nothing is allocated)."""
    import importlib

    import torch
    import transformers

    module, _, name = attention.rpartition(".")
    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k not in ("model_type", "auto_map")})
    with torch.device("meta"):
        layer = getattr(importlib.import_module(f"transformers.models.{module}"), name)(theirs, layer_idx=3)
    assert parse_config(hf).attention_scale == pytest.approx(layer.scaling, rel=1e-12)


@pytest.mark.parametrize("hf, config_class", [(QWEN3_NEXT_80B, "Qwen3NextConfig"), (QWEN3_5_35B_A3B, "Qwen3_5MoeConfig"),
                                              (GPT_OSS_20B, "GptOssConfig")], ids=["qwen3-next", "qwen3.5", "gpt-oss"])
def test_the_layer_kinds_and_rotary_width_are_transformers(hf, config_class):
    """Which layers are Gated DeltaNet (or slide), and how many of a head's dims RoPE turns, as transformers' config
    class derives them from the same file (Qwen3-Next's layer_types from full_attention_interval)."""
    import transformers

    theirs = getattr(transformers, config_class)(**{k: v for k, v in hf.items() if k != "model_type"})
    theirs = getattr(theirs, "text_config", None) or theirs
    cfg = parse_config(hf)
    kinds = cfg.sliding_layers if cfg.sliding_layers else cfg.linear_layers
    assert kinds == tuple(k in ("linear_attention", "sliding_attention") for k in theirs.layer_types)
    factor = theirs.rope_parameters.get("partial_rotary_factor", 1.0)
    assert cfg.rope_dims == int(theirs.head_dim * factor)
