"""A GGUF on a machine without a GPU: the native engine (`Engine.load(..., device="cpu")`, what chat, batch and serve
load there) against llama.cpp (llama-cpp-python's CPU library) on the same file: decode and a 64-token prefill,
each engine in a process of its own, in turns.

Usage (repo root, any machine; no GPU used):
    python3 -c "from pathlib import Path; from moedesk.bench.synthetic_gguf import shape_gguf; \
from moedesk.engine.load.synthetic import shape_config; \
print(shape_gguf(shape_config('qwen3-30b-a3b', 4), 'qwen3-30b-a3b', 'q4_k', Path('/tmp/gg')))"
    python3 tests/perf/cpu_gguf_vs_llamacpp.py /tmp/gg/qwen3-30b-a3b-4L-q4_k.gguf [--tokens 16] [--rounds 2]

Both are fed the same token ids (no tokenizer or template: the shape's file has a placeholder vocabulary); decode is
timed as a (1 + tokens)-token generation less a 1-token one (native) or as `tokens` single-token evaluations
(llama.cpp), with as many threads as torch uses.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.perf.cpu_bf16_experts import in_turns, parse_in_turns  # noqa: E402

PROMPT = list(range(100, 164))


def native(path: str, tokens: int) -> dict:
    import psutil
    import torch

    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    engine = Engine.load(path, device="cpu")
    times = []
    for n in (1, 1 + tokens):  # the prompt's prefill and the first token cancel
        start = time.perf_counter()
        list(engine.generate([Request(PROMPT, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))]))
        times.append(time.perf_counter() - start)
    return dict(engine="native", description=engine.description, threads=torch.get_num_threads(),
                decode_tok_s=round(tokens / (times[1] - times[0]), 2), prefill_tok_s=round(len(PROMPT) / times[0], 1),
                rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2))


def llama_cpp(path: str, tokens: int) -> dict:
    import llama_cpp
    import psutil
    import torch

    model = llama_cpp.Llama(path, n_ctx=512, n_gpu_layers=0, n_threads=torch.get_num_threads(), verbose=False)
    start = time.perf_counter()
    model.eval(PROMPT)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(tokens):
        model.eval([200 + i])
    decode = time.perf_counter() - start
    return dict(engine="llama.cpp", threads=torch.get_num_threads(), decode_tok_s=round(tokens / decode, 2),
                prefill_tok_s=round(len(PROMPT) / prefill, 1),
                rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2))


def main() -> None:
    args = parse_in_turns(__doc__, "gguf", ("native", "llama.cpp"))
    if args.one:
        print(json.dumps((native if args.one == "native" else llama_cpp)(args.gguf, args.tokens)))
        return
    rows = in_turns(__file__, [args.gguf, "--tokens", str(args.tokens)], ("native", "llama.cpp"), args.rounds)
    best = {e: {k: max(r[k] for r in rows if r["engine"] == e) for k in ("decode_tok_s", "prefill_tok_s")}
            for e in ("native", "llama.cpp")}
    print(f"best of {args.rounds}: decode {best['native']['decode_tok_s']} against {best['llama.cpp']['decode_tok_s']}"
          f" tok/s ({best['native']['decode_tok_s'] / best['llama.cpp']['decode_tok_s']:.2f}x), prefill 64 "
          f"{best['native']['prefill_tok_s']} against {best['llama.cpp']['prefill_tok_s']} tok/s "
          f"({best['native']['prefill_tok_s'] / best['llama.cpp']['prefill_tok_s']:.2f}x)")


if __name__ == "__main__":
    main()
