"""A GGUF on a machine without a GPU: the native engine (`Engine.load(..., device="cpu")`, what chat, batch and serve
load there) against llama.cpp (llama-cpp-python's CPU library) on the same file: the prefill of a `--depth`-token
prompt (64 by default) and decode after it, each engine in a process of its own, in turns.

Usage (repo root, any machine; no GPU used):
    python3 -c "from pathlib import Path; from moedesk.bench.synthetic_gguf import shape_gguf; \
from moedesk.engine.load.synthetic import shape_config; \
print(shape_gguf(shape_config('qwen3-30b-a3b', 4), 'qwen3-30b-a3b', 'q4_k', Path('/tmp/gg')))"
    python3 tests/perf/cpu_gguf_vs_llamacpp.py /tmp/gg/qwen3-30b-a3b-4L-q4_k.gguf [--tokens 16] [--rounds 2] \
        [--depth 64] [--native auto,one,all]

--native: how the native engine's forwards share the cores (engine.generation.runner.cores_for): `auto` as it
decides, `one` torch on one thread beside the spinning pool at every forward, `all` every torch thread with the
pool asleep between calls, `torch` as `auto` with a decode step's attention left to torch (not
kernels/cpu_attention.py); each a variant of its own in the turns.

Both are fed the same token ids (no tokenizer or template: the shape's file has a placeholder vocabulary); decode is
the completion's own rate after its first token (native) or `tokens` single-token evaluations (llama.cpp), with as
many threads as torch uses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.perf.cpu_bf16_experts import in_turns  # noqa: E402



def prompt(depth: int) -> list[int]:
    return [100 + i % 1000 for i in range(depth)]


def native(path: str, tokens: int, depth: int, share: str) -> dict:
    import psutil
    import torch

    from moedesk.engine.generation import runner
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    if share == "torch":  # attention in torch everywhere (kernels/cpu_attention.py off), cores_for deciding
        from moedesk.kernels import cpu_attention
        cpu_attention.takes_heads = lambda *heads: False
    elif share != "auto":  # cores_for's decision forced for every forward
        runner.one_thread_forward = lambda *decision: share == "one"
    engine = Engine.load(path, device="cpu", context_length=depth + tokens + 16)
    start = time.perf_counter()
    [done] = engine.generate([Request(prompt(depth), SamplingParams(max_new_tokens=1 + tokens, temperature=0,
                                                                    ignore_eos=True))])
    total = time.perf_counter() - start
    return dict(engine=f"native-{share}", description=engine.description, threads=torch.get_num_threads(),
                decode_tok_s=done.stats["decode_tok_s"], prefill_tok_s=round(depth / done.stats["ttft_s"], 1),
                total_s=round(total, 2), rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2))


def llama_cpp(path: str, tokens: int, depth: int) -> dict:
    import llama_cpp
    import psutil
    import torch

    model = llama_cpp.Llama(path, n_ctx=max(512, depth + tokens + 16), n_batch=512, n_gpu_layers=0,
                            n_threads=torch.get_num_threads(), verbose=False)
    start = time.perf_counter()
    model.eval(prompt(depth))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(tokens):
        model.eval([200 + i])
    decode = time.perf_counter() - start
    return dict(engine="llama.cpp", threads=torch.get_num_threads(), decode_tok_s=round(tokens / decode, 2),
                prefill_tok_s=round(depth / prefill, 1),
                rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--native", default="auto", help="comma-separated: auto, one, all, torch")
    p.add_argument("--one", help=argparse.SUPPRESS)  # one variant, in this process
    args = p.parse_args()
    if args.one:
        row = (llama_cpp(args.gguf, args.tokens, args.depth) if args.one == "llama.cpp" else
               native(args.gguf, args.tokens, args.depth, args.one.removeprefix("native-")))
        print(json.dumps(row))
        return
    variants = [f"native-{share}" for share in args.native.split(",")] + ["llama.cpp"]
    rows = in_turns(__file__, [args.gguf, "--tokens", str(args.tokens), "--depth", str(args.depth)], variants,
                    args.rounds)
    best = {e: {k: max(r[k] for r in rows if r["engine"] == e) for k in ("decode_tok_s", "prefill_tok_s")}
            for e in variants}
    theirs = best["llama.cpp"]
    print(f"best of {args.rounds}, {args.depth}-token prompt: decode and prefill tok/s, ratio to llama.cpp's")
    for e in variants:
        print(f"  {e:12} decode {best[e]['decode_tok_s']:8} ({best[e]['decode_tok_s'] / theirs['decode_tok_s']:.2f}x)"
              f"  prefill {best[e]['prefill_tok_s']:8} ({best[e]['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}x)")


if __name__ == "__main__":
    main()
