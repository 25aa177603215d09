"""`moedesk bench --engine llama.cpp`: decode, prefill and batched decode through moedesk's llama.cpp engine, on a
benchmark shape written as GGUF (bench.synthetic_gguf) or on a GGUF file.

Everything goes through the engine's scheduler, as the app's requests do: what llama-bench measures on the same
file, plus what moedesk's wrapper costs (tests/perf/compare_llamacpp_engine.py puts the two side by side).
"""
from __future__ import annotations

import time

from moedesk.engine.requests import Request, SamplingParams


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(engine, decode_tokens: int = 64, prefills=(512,), batch: int = 16, log=print) -> dict:
    """Tokens per second: one sequence's decode (from its second token), each prefill length (prompt tokens over
    the time to the first token), and `batch` sequences decoding together (their decode rates summed)."""
    vocab = engine.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)
    engine.complete([Request(_prompt(32, vocab, 99), SamplingParams(max_new_tokens=4, **greedy))])  # warm-up
    results = []
    done = engine.complete([Request(_prompt(32, vocab, 0), SamplingParams(max_new_tokens=decode_tokens, **greedy))])
    results.append({"mode": "decode", "batch": 1, "tokens": decode_tokens, "tok_s": done[0].stats["decode_tok_s"]})
    log(f"decode: {results[-1]['tok_s']} tok/s")
    for length in prefills:
        start = time.perf_counter()
        done = engine.complete([Request(_prompt(length, vocab, length), SamplingParams(max_new_tokens=1, **greedy))])
        seconds = done[0].stats["ttft_s"] or (time.perf_counter() - start)
        results.append({"mode": "prefill", "batch": 1, "tokens": length, "tok_s": round(length / seconds, 2)})
        log(f"prefill {length}: {results[-1]['tok_s']} tok/s")
    if batch > 1:
        done = engine.complete([Request(_prompt(32, vocab, 1000 + i), SamplingParams(max_new_tokens=decode_tokens, **greedy))
                                for i in range(batch)])
        rate = sum(c.stats["decode_tok_s"] or 0 for c in done)
        results.append({"mode": "batched_decode", "batch": batch, "tokens": decode_tokens * batch,
                        "tok_s": round(rate, 2)})
        log(f"{batch} sequences: {results[-1]['tok_s']} tok/s")
    return {"engine": engine.kind, "model": engine.name, "placement": engine.why, "description": engine.description,
            "expert_stats": engine.expert_stats(), "warnings": list(engine.warnings), "results": results}


def format_results(report: dict) -> str:
    lines = [f"{report['description']}", f"engine: {report['placement']}"]
    lines += [f"{r['mode']:>15}  batch {r['batch']:>3}  {r['tokens']:>6} tokens  {r['tok_s']:>10} tok/s"
              for r in report["results"]]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def run(shape: str | None, layers: int | None, expert_format: str, gpu_budget: float | None, cpu_moe: int | None,
        device: str, decode_tokens: int, prefills, batch: int, model: str | None = None, log=print) -> dict:
    from moedesk.engine.llamacpp.engine import LlamaCppEngine
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.load.demo import cache_root
    from moedesk.engine.load.synthetic import shape_config
    from moedesk.bench.synthetic_gguf import shape_gguf

    library()  # without llama.cpp: its one line now, not after minutes of writing a GGUF it cannot run
    if model is None:
        cfg = shape_config(shape, layers)
        model = str(shape_gguf(cfg, shape, expert_format, cache_root() / "bench-gguf", log=log))
    context = max([32 + decode_tokens + 8, *[p + 8 for p in prefills]])
    engine = LlamaCppEngine.load(model, device=device, context_length=context, gpu_budget=gpu_budget,
                                 cpu_moe=cpu_moe, why="llama.cpp engine, as asked", count_experts=False)  # as serve
    try:
        engine.make_room(max(1, batch))
        return measure(engine, decode_tokens, prefills, batch, log)
    finally:
        engine.close()
