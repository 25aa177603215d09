"""Memory of a packed model, measured: loading a 4-bit GGUF of a few hundred MB raises the process's resident
memory by at most 1.2x the file size plus the KV cache (experts are read into their stacks with plain reads, not
kept mapped, and never pass through float). The load runs in a child process so that its peak is its own."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from moedesk.kernels.quant_formats import quantize
from tests.load.test_gguf_checkpoint import spm_vocab

gguf = pytest.importorskip("gguf")

CHILD = textwrap.dedent("""
    import json, resource, sys, psutil, torch
    from moedesk.engine.runtime import Engine
    process = psutil.Process()
    # A small model of the same kind first: the code a load brings in (modules, kernels) is not the model's.
    Engine.load(sys.argv[2], device="cpu", dtype="bfloat16", context_length=256)
    before = process.memory_info().rss
    engine = Engine.load(sys.argv[1], device="cpu", dtype="bfloat16", context_length=256)
    after = process.memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kv = engine.cache.bytes_per_position() * engine.cache.length * max(engine.cache.rows, 1)
    formats = sorted({moe.experts.describe() for moe in engine.model.moe_blocks()})
    print(json.dumps({"before": before, "after": after, "peak": peak, "kv": kv, "formats": formats}))
""")


def write_q4_0_moe(path, H=1024, F=2816, E=8, L=8, heads=8, kv=2) -> None:
    """A Mixtral-style GGUF whose experts are q4_0 (~310 MB) and whose other weights are float16, small."""
    gen = torch.Generator().manual_seed(0)
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(H // heads); w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E)
    w.add_expert_used_count(2); w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def f16(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).half().numpy()

    def q4_0(*shape):
        return quantize(torch.randn(shape, generator=gen) * 0.02, "q4_0").numpy()

    hd = H // heads
    w.add_tensor("token_embd.weight", f16(len(pieces), H)); w.add_tensor("output.weight", f16(len(pieces), H))
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", f16(H, H)); w.add_tensor(p + "attn_k.weight", f16(kv * hd, H))
        w.add_tensor(p + "attn_v.weight", f16(kv * hd, H)); w.add_tensor(p + "attn_output.weight", f16(H, H))
        w.add_tensor(p + "ffn_gate_inp.weight", f16(E, H))
        for leaf, shape in (("gate", (E, F, H)), ("up", (E, F, H)), ("down", (E, H, F))):
            w.add_tensor(f"{p}ffn_{leaf}_exps.weight", q4_0(*shape), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_loading_a_4_bit_gguf_costs_about_its_file_size(tmp_path):
    path, small = tmp_path / "q4_0-moe.gguf", tmp_path / "small.gguf"
    write_q4_0_moe(path)
    write_q4_0_moe(small, H=256, F=256, E=2, L=1)
    size = path.stat().st_size
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(small)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert m["formats"] == ["q4_0"]
    grew = m["after"] - m["before"]
    print(f"file {size / 2**20:.0f} MiB: resident +{grew / 2**20:.0f} MiB after load ({grew / size:.2f}x), "
          f"peak {m['peak'] / 2**20:.0f} MiB ({(m['peak'] - m['before']) / size:.2f}x the file above the start)")
    assert grew <= 1.2 * size + m["kv"]
