"""A float32 load on the CPU alone, its bfloat16-stored experts kept in bfloat16 (engine.load.loader.expert_stack_dtype)
against the same load with `--expert-dtype bf16`, which holds them in the weights dtype (every CPU load before the
rule): resident memory after the load and decode speed, each in a process of its own, in turns.

Usage (repo root, any machine; no GPU used):
    python3 tests/perf/make_mixtral_checkpoint.py /tmp/mx2 --layers 2
    python3 tests/perf/cpu_bf16_experts.py /tmp/mx2 [--tokens 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(model: str, experts: str, tokens: int) -> dict:
    import psutil
    import torch

    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    start = time.perf_counter()
    engine = Engine.load(model, device="cpu", dtype="float32", expert_dtype="auto" if experts == "bfloat16" else "bf16")
    loaded = time.perf_counter() - start
    held = {str(moe.experts.dense_dtype).removeprefix("torch.") for moe in engine.model.moe_blocks()}
    prompt = engine.tokenizer.encode("Experts live in RAM; the most popular ones live on the GPU. " * 4)
    times = []
    for n in (1, 1 + tokens):  # decode = the difference: the prompt's prefill and the first token cancel
        start = time.perf_counter()
        list(engine.generate([Request(prompt, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))]))
        times.append(time.perf_counter() - start)
    return dict(experts=experts, held=sorted(held), load_s=round(loaded, 1), threads=torch.get_num_threads(),
                rss_gib=round(psutil.Process().memory_info().rss / 2**30, 2),
                decode_tok_s=round(tokens / (times[1] - times[0]), 2))


def parse_in_turns(doc: str, target: str, variants) -> argparse.Namespace:
    """The command line of a script that measures `variants` of one load of `target` with `in_turns`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(target)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", choices=variants, help=argparse.SUPPRESS)  # one variant, in this process
    return p.parse_args()


def in_turns(script: str, argv: list[str], variants, rounds: int) -> list[dict]:
    """`script argv --one VARIANT` for each variant, `rounds` times in turns, each in a process of its own (a load's
    memory and threads start clean): the JSON line each printed last, echoed as it comes."""
    rows = []
    for _ in range(rounds):
        for variant in variants:
            out = subprocess.run([sys.executable, script, *argv, "--one", variant], capture_output=True, text=True,
                                 check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    args = parse_in_turns(__doc__, "model", ("bfloat16", "float32"))
    if args.one:
        print(json.dumps(one(args.model, args.one, args.tokens)))
        return
    rows = in_turns(__file__, [args.model, "--tokens", str(args.tokens)], ("bfloat16", "float32"), args.rounds)
    best = {e: max(r["decode_tok_s"] for r in rows if r["experts"] == e) for e in ("bfloat16", "float32")}
    rss = {e: min(r["rss_gib"] for r in rows if r["experts"] == e) for e in ("bfloat16", "float32")}
    print(f"decode, best of {args.rounds}: bf16 experts {best['bfloat16']} tok/s, float32 {best['float32']} tok/s "
          f"({best['bfloat16'] / best['float32']:.2f}x); resident {rss['bfloat16']} GiB against {rss['float32']} GiB")


if __name__ == "__main__":
    main()
