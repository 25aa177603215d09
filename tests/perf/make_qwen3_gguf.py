"""Write a random-weight Qwen3-30B-A3B-shaped GGUF (first L layers, F16) for llama.cpp speed comparisons.

Usage: GGUF_PY=<llama.cpp>/gguf-py python3 tests/perf/make_qwen3_gguf.py OUT.gguf L [--tiny]

The companion of the GPU box's llama.cpp make_gguf.py (Mixtral shape) for the fine-grained shape of
`moedesk bench --shape qwen3-30b-a3b`, written as `moedesk bench --engine llama.cpp` writes it
(bench/synthetic_gguf.py): 128 experts of 2048x768, top-8, 32 query and 4 key/value heads of 128, per-head q/k
RMSNorm, weights tiled from one random block, a placeholder vocabulary. --tiny writes the same architecture at toy
sizes, to check here that llama.cpp loads what this writes. GGUF_PY: a gguf-py to use instead of the installed one.
"""
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.environ.get("GGUF_PY", "gguf-py"))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", ".."))

from moedesk.bench.synthetic_gguf import write_f16  # noqa: E402
from moedesk.engine.load.synthetic import shape_config  # noqa: E402


def main() -> None:
    out, layers = Path(sys.argv[1]), int(sys.argv[2])
    cfg = shape_config("qwen3-30b-a3b", layers)
    if "--tiny" in sys.argv[3:]:
        cfg = replace(cfg, hidden_size=64, moe_intermediate_size=32, intermediate_size=256, num_experts=8,
                      num_experts_per_tok=2, vocab_size=512, num_heads=4, num_kv_heads=2, head_dim=16)
    write_f16(cfg, out)
    print("wrote", out, os.path.getsize(out) / 1e9, "GB")


if __name__ == "__main__":
    main()
