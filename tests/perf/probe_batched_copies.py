"""Probe (GPU box; python3 tests/perf/probe_batched_copies.py [--format q4_0] [--batch 16]): in a batched decode
step of packed Mixtral experts, all in RAM, how many of a layer's experts should be copied to the GPU while the CPU
computes the rest, and how close does the latency model's choice come to the best fixed count?

One synthetic model (mixtral-8x7b shape, 8 layers, GPU budget 0), profiled as `moedesk bench` profiles it. Then
rounds of batched decode, the policies taking turns: "model" (the engine's own `decide`), "model, alone" (the same
rule with every CPU expert priced at a call of its own, as before the profile timed calls of several) and "copy k"
(the k experts with the most tokens copied, the rest on the CPU). Printed per policy: tok/s (median of the rounds) and,
per layer, experts copied, the host's CPU-kernel time, the wait for the routing and the whole layer's host time.
Also printed: the profile's one-expert CPU times (expert 0 again and again, as the profiler times them) against the
same calls taking a different expert each time (from RAM, not the last-level cache).

What came of it (H200 machines, 2026-11-27, Mixtral q4_0, 16 sequences): at 62b08c7's profile (one expert timed
again and again from the 300 MiB cache: 0.96 ms at four tokens where taking turns took 1.22; the contention of a
one-token bf16 call, CPU 1.89x slower beside copies) the model copied 4 of a layer's ~8 experts: 222 tok/s, against
224 / 227 / 264 / 275 / 226 / 188 copying the 0 / 1 / ... / 5 busiest. With the experts timed taking turns and the
contention measured per token count (CPU 1.23x at one token, 1.10x at four, 1.01x at sixteen), another machine's
model copied 3: 283 tok/s, against 270 / 279 / 226 copying 2 / 3 / 4. With a CPU expert priced at its share of a call of
several (a1c768e), 288.2 tok/s (2.73 copies a layer) against 264.6 (2.99) priced alone and 285.5 / 270.8 / 222.8
copying 2 / 3 / 4; at 4 sequences 108.1 against 106.4, 115.9 / 116.9 copying 0 / 1 (docs/measurements.md).
`--prefill N` times prefills instead (any shape, `--gpu-budget`), and on a GPU the host time of back-to-back copies
is printed beside the profile's copy_launch_ms.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.bench.synthetic import measure_decode, measure_prefill, prepare_synthetic  # noqa: E402
from moedesk.engine.offload.latency_model import fit_latency_model  # noqa: E402
from moedesk.engine.offload.assignment import RememberedSplit, assign_offloaded  # noqa: E402
from moedesk.kernels.experts import experts_forward_routed  # noqa: E402


def copy_top(k):
    def decide(loads):
        order = sorted((e for e, n in loads.items() if n > 0), key=lambda e: (-loads[e], e))
        return sorted(order[k:]), order[:k]
    return decide


def one_expert_ms(bank, dtype, tokens, rotate: bool, repeat: int = 9) -> float:
    x = torch.randn(tokens, bank.hidden, dtype=dtype)
    out = torch.empty_like(x)
    times = []
    for i in range(repeat + 1):
        e = (i % bank.num_experts) if rotate else 0
        pe = torch.full((tokens,), e, dtype=torch.int64)
        t = time.perf_counter()
        experts_forward_routed(x, pe, 1, None, bank, out)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])


def copies_host_ms(bank, dtype, device, k: int, tokens: int = 32, repeat: int = 5) -> float:
    """Host time a copied expert costs when k are queued back to back (copy, then compute), per copy: the profile's
    copy_launch_ms times one with the GPU drained before it."""
    from moedesk.engine.offload.offload_executor import compute_copied, queue_copy

    slots = [bank.expert(0).empty_like(device) for _ in range(min(k, 8))]
    side, x = torch.cuda.Stream(device), torch.randn(tokens, bank.hidden, dtype=dtype, device=device)
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for i in range(k):
            slot = slots[i % len(slots)]
            compute_copied(x, slot, queue_copy(side, bank.expert(i % bank.num_experts), slot))
        times.append((time.perf_counter() - t) * 1e3 / k)
    torch.cuda.synchronize(device)
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="q4_0")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--copies", default="0,1,2,3,4,5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0, help="time a prefill of this many tokens instead of decode")
    ap.add_argument("--gpu-budget", type=float, default=0.0)
    args = ap.parse_args()
    bench = prepare_synthetic(args.shape, args.layers, args.gpu_budget, expert_format=args.format, log=lambda *a: None)
    ex, prof = bench.executor, bench.profile
    model_decide = ex.decide
    # The rule as it was before the profile timed calls of several experts: every CPU expert priced at a call of
    # its own (the profile without cpu_call_ms).
    alone = fit_latency_model({k: v for k, v in prof.items() if k not in ("cpu_call_ms", "cpu_call_experts")})
    policies = {"model": model_decide, "model, alone": RememberedSplit(lambda loads: assign_offloaded(loads, alone)),
                **{f"copy {k}": copy_top(int(k)) for k in args.copies.split(",")}}
    print(f"calls of {prof.get('cpu_call_experts')} experts, ms: {prof.get('cpu_call_ms')}")
    bank = next(iter(bench.banks.values()))
    print("one expert on the CPU, ms (tokens: same expert / a different one each call / profile):")
    for t in (1, 2, 4, 8):
        same, turns = (one_expert_ms(bank, bench.dtype, t, rotate) for rotate in (False, True))
        print(f"  {t}: {same:.3f} / {turns:.3f} / {prof['cpu_expert_ms'][t]:.3f}")
    if bench.device.type == "cuda":
        print(f"copy launch {prof.get('copy_launch_ms')} ms; back to back, per copy: "
              + ", ".join(f"{k}: {copies_host_ms(bank, bench.dtype, bench.device, k):.3f}" for k in (1, 16, 64)))
    print(f"copy {prof['copy_expert_ms']:.3f} ms, slowdowns cpu {prof.get('cpu_slowdown_during_copy')} "
          f"copy {prof.get('copy_slowdown_during_cpu')}")
    runs = {name: [] for name in policies}
    names = list(policies)
    for r in range(args.rounds):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]
            ex.decide = policies[name]
            if args.prefill:
                ex.stats = type(ex.stats)()
                res = measure_prefill(bench.model, ex, bench.cfg, bench.device, bench.dtype, args.prefill,
                                      seed=100 * r, repeat=1)
                steps = 1
            else:
                res = measure_decode(bench.model, ex, bench.cfg, bench.device, bench.dtype, args.batch, args.tokens,
                                     seed=100 * r)
                steps = args.tokens - 2
            layers = steps * bench.cfg.num_layers
            s = ex.stats
            runs[name].append({"tok_s": res.tok_s, "copied": s.copied_experts / layers,
                               "cpu": s.cpu_experts / layers,
                               "cpu_ms": s.cpu_ms / layers, "wait_ms": s.wait_ms / layers,
                               "layer_ms": s.layer_ms / layers, "step_ms": 1e3 * res.seconds / steps})
    ex.decide = model_decide
    memory = getattr(model_decide, "memory", {})
    seen = [(key, len(cpu), len(copy)) for key, (cpu, copy) in list(memory.items())[-10:]]
    out = os.environ.get("OUT", "/tmp")
    json.dump({"profile": prof, "runs": runs, "model_choices": seen}, open(f"{out}/batched_copies.json", "w"),
              default=str, indent=1)
    print("model's choices (loads: cpu, copied):", "; ".join(f"{k}: {c}, {g}" for k, c, g in seen))
    print(f"{'policy':<10}{'tok/s':>8}{'step ms':>9}{'copied':>8}{'cpu':>6}{'cpu ms':>8}{'wait ms':>9}{'layer ms':>10}")
    for name, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name:<10}{m['tok_s']:>8.1f}{m['step_ms']:>9.2f}{m['copied']:>8.2f}{m['cpu']:>6.2f}{m['cpu_ms']:>8.3f}"
              f"{m['wait_ms']:>9.3f}{m['layer_ms']:>10.3f}")


if __name__ == "__main__":
    main()
