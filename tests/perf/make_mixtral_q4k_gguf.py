"""Write a whole Mixtral-8x7B-shaped GGUF (32 layers) with Q4_K experts, quantised from the start, for
tests/perf/load_under_cgroup.sh.

Usage: python tests/perf/make_mixtral_q4k_gguf.py OUT.gguf [LAYERS]
(MIXTRAL_DIMS=hidden,ffn,experts,top_k,heads,kv_heads, e.g. 256,512,4,2,4,2, writes a toy of it to check here.)

Its experts are the bulk of a Q4_K_M file (~25 GB of 26); the rest is F16 (a real Q4_K_M keeps some of it in
Q6_K). Random weights: a few rows of valid Q4_K blocks tiled (tests/perf/make_family_gguf.py), one array shared
by every layer, so writing takes a few hundred MB of RAM; the small SentencePiece vocabulary of the GGUF tests,
which the native engine tokenises with.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import gguf  # noqa: E402

from tests.load.test_gguf_checkpoint import spm_vocab  # noqa: E402
from moedesk.bench.synthetic_gguf import tiled  # noqa: E402
from tests.perf.make_family_gguf import packed, values  # noqa: E402

# mistralai/Mixtral-8x7B-v0.1's config.json, unless MIXTRAL_DIMS says otherwise
H, F, E, TOP, HEADS, KV = (int(v) for v in os.environ.get("MIXTRAL_DIMS", "4096,14336,8,2,32,8").split(","))


def main() -> None:
    out = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(layers); w.add_context_length(32768); w.add_embedding_length(H)
    w.add_feed_forward_length(F); w.add_head_count(HEADS); w.add_head_count_kv(KV); w.add_rope_freq_base(1e6)
    w.add_rope_dimension_count(H // HEADS); w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E)
    w.add_expert_used_count(TOP); w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def f16(*shape):
        return tiled(int(np.prod(shape)), values).astype(np.float16).reshape(shape)

    hd = H // HEADS
    q, kv, o, router = f16(H, H), f16(KV * hd, H), f16(H, H), f16(E, H)
    (gate_up, qtype), (down, _) = packed((E, F, H), "q4_k"), packed((E, H, F), "q4_k")
    ones = np.ones(H, dtype=np.float32)
    w.add_tensor("token_embd.weight", f16(len(pieces), H)); w.add_tensor("output.weight", f16(len(pieces), H))
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones); w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", q); w.add_tensor(p + "attn_k.weight", kv)
        w.add_tensor(p + "attn_v.weight", kv); w.add_tensor(p + "attn_output.weight", o)
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        for leaf, data in (("gate", gate_up), ("up", gate_up), ("down", down)):
            w.add_tensor(f"{p}ffn_{leaf}_exps.weight", data, raw_dtype=qtype)
    start = time.perf_counter()
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(progress=True); w.close()
    seconds, size = time.perf_counter() - start, os.path.getsize(out)
    print(f"wrote {size / 1e9:.2f} GB in {seconds:.0f} s ({size / 1e9 / seconds:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
