"""Write a random-weight Qwen3-30B-A3B-shaped GGUF (first L layers, F16) for llama.cpp speed comparisons.

Usage: GGUF_PY=<llama.cpp>/gguf-py python3 tests/perf/make_qwen3_gguf.py OUT.gguf L [--tiny]

The companion of the GPU box's llama.cpp make_gguf.py (Mixtral shape) for the fine-grained
shape of `moedesk bench --shape qwen3-30b-a3b`: 128 experts of 2048x768, top-8, 32 query and 4
key/value heads of 128, per-head q/k RMSNorm. Weights tile one random block (speed does not
depend on the values); the vocabulary is placeholder tokens, enough for llama-bench. --tiny
writes the same architecture at toy sizes, to check here that llama.cpp loads what this writes.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.environ.get("GGUF_PY", "gguf-py"))
import gguf  # noqa: E402

out, L = sys.argv[1], int(sys.argv[2])
tiny = "--tiny" in sys.argv[3:]
if tiny:
    H, F, E, K, V, NH, NKV, D = 64, 32, 8, 2, 512, 4, 2, 16
else:
    H, F, E, K, V, NH, NKV, D = 2048, 768, 128, 8, 151936, 32, 4, 128
rng = np.random.default_rng(0)
block = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(np.float16)


def rnd(*shape):
    n = int(np.prod(shape))
    reps = -(-n // block.size)
    return np.tile(block, reps)[:n].reshape(shape) if reps > 1 else block[:n].reshape(shape).copy()


def ones(n):
    return np.ones(n, dtype=np.float32)


w = gguf.GGUFWriter(out, "qwen3moe")
w.add_name("qwen3-30b-a3b-shape-random")
w.add_context_length(4096)
w.add_embedding_length(H)
w.add_block_count(L)
w.add_feed_forward_length(6144 if not tiny else 4 * H)
w.add_expert_feed_forward_length(F)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_key_length(D)
w.add_value_length(D)
w.add_rope_freq_base(1e6)
w.add_layer_norm_rms_eps(1e-6)
w.add_expert_count(E)
w.add_expert_used_count(K)
w.add_file_type(1)
toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
toks += [f"t{i}" for i in range(V - len(toks))]
w.add_tokenizer_model("llama")
w.add_token_list(toks)
w.add_token_scores([0.0] * V)
w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (V - 259))
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(0)
w.add_tensor("token_embd.weight", rnd(V, H))
w.add_tensor("output_norm.weight", ones(H))
w.add_tensor("output.weight", rnd(V, H))
for i in range(L):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", ones(H))
    w.add_tensor(p + "attn_q.weight", rnd(NH * D, H))
    w.add_tensor(p + "attn_k.weight", rnd(NKV * D, H))
    w.add_tensor(p + "attn_v.weight", rnd(NKV * D, H))
    w.add_tensor(p + "attn_output.weight", rnd(H, NH * D))
    w.add_tensor(p + "attn_q_norm.weight", ones(D))
    w.add_tensor(p + "attn_k_norm.weight", ones(D))
    w.add_tensor(p + "ffn_norm.weight", ones(H))
    w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, H), dtype=np.float32))
    w.add_tensor(p + "ffn_gate_exps.weight", rnd(E, F, H))
    w.add_tensor(p + "ffn_up_exps.weight", rnd(E, F, H))
    w.add_tensor(p + "ffn_down_exps.weight", rnd(E, H, F))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file(progress=False)
w.close()
print("wrote", out, os.path.getsize(out) / 1e9, "GB")
