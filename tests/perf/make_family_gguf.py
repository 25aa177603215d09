"""Write a random-weight GGUF of a 2026 MoE family's real shape (its first L layers) for llama.cpp speed runs.

Usage: python tests/perf/make_family_gguf.py SHAPE OUT.gguf L [--experts mxfp4|q4_k|q4_0|q8_0|f16] [--vocab N] [--tiny]

SHAPE: gpt-oss-120b, gpt-oss-20b (experts MXFP4 by default, as the released checkpoints), glm-4.5-air, deepseek-v3,
qwen3.5-35b-a3b, minimax-m2, qwen3-30b-a3b (experts q4_k by default: the bulk of a Q4_K_M file). The tensors, names and metadata
come from tests/gguf_from_hf.py (the families that test_new_archs.py checks against transformers), laid out from the
transformers model built on the meta device, so no full-size float copy exists. Speed does not depend on the values:
every tensor tiles one random block, the rest of the model in F16, except what llama.cpp's converter always keeps in
F32 (1-D tensors, routers, Gated DeltaNet's convolution: llama.cpp's CPU kernel for it reads F32 only and aborts on
anything else). A q4_k tensor whose rows are not whole 256-weight blocks (GLM-4.5-Air's 1408-wide down projection)
falls back to q4_0, as llama.cpp's own quantiser falls back. The vocabulary is placeholder tokens, enough for
llama-bench and `moedesk bench --engine llama.cpp`. --tiny keeps the family and its switches at toy sizes (TINY),
for the CPU tests.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import gguf  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from moedesk.bench.synthetic_gguf import add_placeholder_vocabulary, tiled  # noqa: E402
from tests.gguf_from_hf import FAMILIES, gguf_tensors, model_metadata  # noqa: E402

SHAPES = {
    # openai/gpt-oss-120b and -20b's config.json
    "gpt-oss-120b": ("gpt-oss", "mxfp4", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5)),
    "gpt-oss-20b": ("gpt-oss", "mxfp4", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5)),
    # zai-org/GLM-4.5-Air's config.json (engine/load/synthetic.py's glm-4.5-air)
    "glm-4.5-air": ("glm4moe", "q4_k", dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
        max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=0)),
    # deepseek-ai/DeepSeek-V3's config.json (without its YaRN rope scaling: speed does not see it)
    "deepseek-v3": ("deepseek2", "q4_k", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=0)),
    # Qwen/Qwen3.5-35B-A3B's text_config (engine/load/synthetic.py's qwen3.5-35b-a3b): Gated DeltaNet layers, every
    # fourth gated full attention, 256 experts top-8 and a shared expert
    "qwen3.5-35b-a3b": ("qwen35moe", "q4_k", dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                            "mrope_section": [11, 11, 10], "mrope_interleaved": True})),
    # Qwen/Qwen3-30B-A3B's config.json (engine/load/synthetic.py's qwen3-30b-a3b): issue 42's whole-model 8 GiB target
    "qwen3-30b-a3b": ("qwen3moe", "q4_k", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)),
    # MiniMaxAI/MiniMax-M2's config.json (engine/load/synthetic.py's minimax-m2): q/k norms over all heads, half of
    # each head rotated, 256 experts top-8, sigmoid routing
    "minimax-m2": ("minimax-m2", "q4_k", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
        num_key_value_heads=8, head_dim=128, num_local_experts=256, num_experts_per_tok=8,
        max_position_embeddings=196608, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5})),
}
# --tiny: each shape's dimensions cut down (a key the shape does not have is not added); every switch stays.
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_local_experts=8, n_routed_experts=8, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=256, shared_expert_intermediate_size=256, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, n_group=4, topk_group=2,
            q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            sliding_window=8, max_position_embeddings=4096)
# What llama.cpp's converter writes in F32 whatever the file type (conversion/base.py), among these families' tensors.
ALWAYS_F32 = re.compile(r"blk\.\d+\.(?:ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d)\.weight")
QTYPES = {"mxfp4": gguf.GGMLQuantizationType.MXFP4, "q4_k": gguf.GGMLQuantizationType.Q4_K,
          "q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0,
          "f16": gguf.GGMLQuantizationType.F16}
ROUTED = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down)_exps\.weight")
rng = np.random.default_rng(0)
values = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02)


def drawn(name: str, n: int) -> np.ndarray:
    """`n` of the random values for tensor `name`, from a place of its own in them: tensors that all began at the
    same value were alike (a router's first row equal to a bias), so every token picked the same expert."""
    start = zlib.crc32(name.encode()) % len(values)
    if start + n <= len(values):
        return values[start:start + n]
    return tiled(n, np.concatenate((values[start:], values[:start])))


def q4_k_block_row(k: int) -> np.ndarray:
    """One row of valid Q4_K blocks (144 bytes per 256 weights): random scales and nibbles, small d and dmin."""
    blocks = rng.integers(0, 256, size=(k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(5e-4).tobytes(), np.uint8)
    return blocks.reshape(-1)


def packed(shape: tuple[int, ...], fmt: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Random data of `shape` (rows of K weights) in `fmt`, as uint8 rows the GGUF writer takes raw."""
    k = shape[-1]
    if fmt == "q4_k" and k % 256:
        fmt = "q4_0"
    qtype = QTYPES[fmt]
    rows = int(np.prod(shape[:-1]))
    if fmt == "f16":
        return tiled(rows * k, values).astype(np.float16).reshape(shape), qtype
    if fmt == "q4_k":
        distinct = np.stack([q4_k_block_row(k) for _ in range(7)])
    else:
        distinct = quantize(values[:7 * k].reshape(7, k), qtype)
    data = np.tile(distinct, (-(-rows // 7), 1))[:rows]  # a few distinct rows, tiled
    return data.reshape(*shape[:-1], distinct.shape[1]), qtype


def main() -> None:
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("layers", type=int)
    ap.add_argument("--experts", choices=sorted(QTYPES), help="the routed experts' format (default: the shape's)")
    ap.add_argument("--vocab", type=int, help="a smaller vocabulary, to check quickly that llama.cpp loads the file")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions, the same architecture (for CPU tests)")
    args = ap.parse_args()
    family, default_format, config = SHAPES[args.shape]
    if args.tiny:
        config = {**config, **{key: value for key, value in TINY.items() if key in config}}
        if config.get("num_key_value_heads") == SHAPES[args.shape][2].get("num_attention_heads"):  # MLA: one per head
            config["num_key_value_heads"] = config["num_attention_heads"]
    if args.vocab:
        config = {**config, "vocab_size": args.vocab}
    fam = FAMILIES[family]
    config = getattr(transformers, fam.config_class)(**{**config, "num_hidden_layers": args.layers})
    with torch.device("meta"):
        model = getattr(transformers, fam.model_class)(config)
    hub = revert_weight_conversion(model, model.state_dict())  # the Hub's layout: what the converter reads
    cfg = config.to_dict()

    w = gguf.GGUFWriter(args.out, fam.gguf_arch)
    w.add_name(f"{args.shape}-shape-random-{args.layers}-layers")
    model_metadata(w, family, cfg)
    add_placeholder_vocabulary(w, cfg["vocab_size"])
    expert_format = args.experts or default_format
    for name, t in gguf_tensors(family, cfg, hub):
        shape = tuple(t.shape)
        if ROUTED.fullmatch(name):
            data, qtype = packed(shape, expert_format)
            w.add_tensor(name, data, raw_dtype=qtype)
            continue
        data = drawn(name, int(np.prod(shape))).reshape(shape)
        if ALWAYS_F32.fullmatch(name):
            w.add_tensor(name, data)
        elif len(shape) >= 2 and name.endswith(".weight"):
            w.add_tensor(name, data.astype(np.float16))
        elif name.endswith(".ssm_a"):  # Gated DeltaNet's A = -exp(A_log): negative, or the state grows without bound
            w.add_tensor(name, -np.abs(data) - 0.5)
        elif name.endswith(".bias"):  # centred, as engine/load/synthetic.py's: a bias near 1 in every dimension
            # (attention's output, an expert's down projection) gives each token the same residual, so every
            # token's router picks the same few experts, and llama.cpp's prefill copies only those
            w.add_tensor(name, data)
        else:  # norms, sinks: float32, as the converter keeps them
            w.add_tensor(name, data + 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print("wrote", args.out, f"{os.path.getsize(args.out) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
