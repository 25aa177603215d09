"""The benchmark shapes (engine.load.synthetic.SHAPES) written as GGUF files, for `moedesk bench --engine llama.cpp`.

Random weights (speed does not depend on the values) tiled from one block, written in F16 one tensor at a time and
quantised by llama.cpp's own quantiser to the format asked for (bench.gguf_quantize); the files are kept in the
cache folder, a shape, layer count and format each, because a full-size write and quantisation takes minutes.
tests/perf's GGUF writers (the llama-bench comparisons) take `tiled` and `add_placeholder_vocabulary` from here, and
the Qwen3 one all of it.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moedesk.bench.gguf_quantize import quantize
from moedesk.engine.errors import MoedeskError
from moedesk.engine.model.config import ModelConfig

# --expert-format -> llama.cpp's file type (llama.h LLAMA_FTYPE_*): what its quantiser writes for that format
FILE_TYPES = {"dense": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18}
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
BLOCK = 1 << 22  # values in the random block that tiles every tensor


def shape_gguf(cfg: ModelConfig, name: str, expert_format: str, folder: Path, log=print) -> Path:
    """The GGUF of `cfg` (first cfg.num_layers layers) in `expert_format`, written once into `folder`."""
    if expert_format not in FILE_TYPES:
        raise MoedeskError(f"--expert-format {expert_format}: llama.cpp's bench takes {', '.join(FILE_TYPES)}")
    if cfg.arch not in GGUF_ARCH:
        raise MoedeskError(f"--shape {name}: no GGUF writer for {cfg.arch} (have {', '.join(GGUF_ARCH)})")
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{name}-{cfg.num_layers}L-{expert_format}.gguf"
    if final.is_file():
        return final
    f16 = folder / f"{name}-{cfg.num_layers}L-dense.gguf"
    if not f16.is_file():
        log(f"writing {f16} (F16, random weights)")
        write_f16(cfg, f16.with_suffix(".partial"))
        os.replace(f16.with_suffix(".partial"), f16)
    if expert_format == "dense":
        return f16
    log(f"quantising to {expert_format} with llama.cpp's quantiser")
    quantize(f16, final, FILE_TYPES[expert_format], log=log)
    return final


def write_f16(cfg: ModelConfig, path: Path) -> None:
    """cfg as an F16 GGUF of llama.cpp's layout for its architecture, streamed a tensor at a time."""
    import gguf

    rng = np.random.default_rng(0)
    block = (rng.standard_normal(BLOCK, dtype=np.float32) * 0.02).astype(np.float16)
    H, E, F, V = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    NH, NKV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (V, H), "rnd"),
                                                       ("output_norm.weight", (H,), "one"),
                                                       ("output.weight", (V, H), "rnd")]
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (H,), "one"), (p + "attn_q.weight", (NH * D, H), "rnd"),
                    (p + "attn_k.weight", (NKV * D, H), "rnd"), (p + "attn_v.weight", (NKV * D, H), "rnd"),
                    (p + "attn_output.weight", (H, NH * D), "rnd"), (p + "ffn_norm.weight", (H,), "one"),
                    (p + "ffn_gate_inp.weight", (E, H), "router"), (p + "ffn_gate_exps.weight", (E, F, H), "rnd"),
                    (p + "ffn_up_exps.weight", (E, F, H), "rnd"), (p + "ffn_down_exps.weight", (E, H, F), "rnd")]
        if cfg.qk_norm == "head":
            tensors += [(p + "attn_q_norm.weight", (D,), "one"), (p + "attn_k_norm.weight", (D,), "one")]

    def value(shape, kind):
        if kind == "one":
            return np.ones(shape, dtype=np.float32)
        if kind == "router":
            return rng.standard_normal(shape, dtype=np.float32)
        return tiled(int(np.prod(shape)), block).reshape(shape)

    w = gguf.GGUFWriter(str(path), GGUF_ARCH[cfg.arch])
    w.add_name(f"{cfg.arch}-shape-random")
    w.add_context_length(cfg.max_position_embeddings)  # a long prompt runs as deep as the real model allows
    w.add_embedding_length(H)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_value_length(D)
    if cfg.arch == "mixtral":
        w.add_rope_dimension_count(D)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_file_type(1)
    add_placeholder_vocabulary(w, V)
    for name, shape, kind in tensors:
        dtype = np.float32 if kind in ("one", "router") else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(value(shape, kind))
    w.close()


def tiled(n: int, block: np.ndarray) -> np.ndarray:
    """`n` values repeating `block`: a tensor of random weights without drawing each one."""
    return np.resize(block, n)


def add_placeholder_vocabulary(w, size: int) -> None:
    """A vocabulary of `size` tokens for GGUF writer `w`: llama's control and byte tokens, then t0, t1, ...
    Enough for llama-bench and the llama.cpp engine, which time token ids and never read them as text."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(size - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * size)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (size - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
