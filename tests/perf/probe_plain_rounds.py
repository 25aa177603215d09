"""Why an auto round that drafts nothing (γ = 0) can cost more than a plain decode step (issue 16: auto lost 7% at
B = 16, acceptance 0.5, on the Qwen3 shape, its γ = 0 rounds at 85 ms against the plain step's 73).

Usage (GPU box, repo root): python3 tests/perf/probe_plain_rounds.py [--shape S] [--layers L] [--batch B]
[--tokens N] [--rounds R]. One synthetic model, every expert in RAM; per round, plain batched decode
(bench.speculative.plain_decode) and a speculative run in auto mode whose costs make every draft length lose
(so every round is γ = 0), alternating. Prints the plain step's time beside the γ = 0 rounds' verify and accept
times, then torch.profiler's top host-side ops of one run of each, so the two paths can be compared op by op.
"""
import argparse
import statistics

import torch

from moedesk.bench.synthetic import prepare_synthetic, random_prompt
from moedesk.bench.speculative import PROMPT_TOKENS, OracleCosts, plain_decode, speculative_decode
from moedesk.engine.speculative.verification import Speculator

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="qwen3-30b-a3b")
parser.add_argument("--layers", type=int, default=12)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--tokens", type=int, default=24)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
gamma, b = 4, args.batch
context = PROMPT_TOKENS + args.tokens + 2 * (gamma + 1) + 8
bench = prepare_synthetic(args.shape, args.layers, 0.0, "cuda", context)
cfg = bench.cfg
spec = Speculator(bench.model, bench.device, bench.dtype, context, cfg.eos_token_ids)
prompts = [random_prompt(PROMPT_TOKENS, cfg.vocab_size, 100 + i) for i in range(b)]
never = OracleCosts({(b, k): 1.0 if k == 1 else 1000.0 for k in range(1, gamma + 2)})  # no draft ever pays


def plain():
    reference, tok_s, step_ms = plain_decode(bench, prompts, args.tokens + gamma, context)
    return reference, step_ms


def undrafted(reference):
    run = speculative_decode(bench, spec, prompts, args.tokens, 0.5, gamma, "auto", never, seed=7,
                             references=reference)
    assert run["gammas"] == [0], run["gammas"]
    return run


reference, _ = plain()
undrafted(reference)  # warm-up: the speculator's graphs and buffers
rows = []
for _ in range(args.rounds):
    reference, step_ms = plain()
    run = undrafted(reference)
    rows.append((step_ms, run["verify_ms"], run["accept_ms"], b / run["tok_s"] * 1000 if run["tok_s"] else None))
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
for name, call in (("plain", lambda: plain()), ("gamma-0 rounds", lambda: undrafted(reference))):
    with torch.profiler.profile(activities=acts) as p:
        call()
    print(f"\n--- {name}")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
print(f"\n{'plain step ms':>14}{'verify ms':>11}{'accept ms':>11}{'round ms':>10}")
for step_ms, verify, accept, per in rows:
    print(f"{step_ms:>14.2f}{verify:>11.2f}{accept:>11.2f}{per:>10.2f}")
print(f"median: plain {statistics.median(r[0] for r in rows):.2f} ms, gamma-0 round "
      f"{statistics.median(r[1] + r[2] for r in rows):.2f} ms (verify + accept)")
