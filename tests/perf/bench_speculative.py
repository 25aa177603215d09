"""Speculative decoding against plain decoding on a synthetic model of real shape, with a draft of known acceptance.

No trained head exists for a synthetic model, so the draft is an oracle: the target's own greedy continuation
(from the plain run that is also the baseline), each drafted token replaced by a random one with probability
1 - α. Drafting then costs nothing, so what is measured is what verification costs and yields on this
machine and placement (issue 16, item 7). For every batch size B, acceptance α and draft length γ, one JSON
line: measured tok/s speculative and plain, their ratio, the target efficiency T(B,1)/T(B,γ+1) from timed
forwards of k tokens per sequence, and the MoESD model's predicted speedup from those timed forwards
(perf_model.predicted_speedup over the measured table; and from a fitted model when the table has enough
points). Plain decoding replays CUDA graphs where the engine would; verification runs eagerly.

    python3 tests/perf/bench_speculative.py                          # Mixtral shape, every expert in RAM
    python3 tests/perf/bench_speculative.py --shape qwen3-30b-a3b --batches 1 4 16
    python3 tests/perf/bench_speculative.py --smoke                  # tiny shape on the CPU: the code path only
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.bench import random_prompt  # noqa: E402
from engine.generation.cuda_graphs import GraphedDecode, graphs_wanted  # noqa: E402
from engine.generation.decoder import Decoder  # noqa: E402
from engine.generation.kv_cache import KVCache  # noqa: E402
from engine.requests import Request, SamplingParams  # noqa: E402
from engine.speculative import perf_model  # noqa: E402
from engine.speculative.decode import Speculator, measure_step_times, oracle_factory  # noqa: E402


def _build():
    # bench_beam's build: the synthetic model profiled, calibrated and placed as `moedesk bench` does
    spec = importlib.util.spec_from_file_location("bench_beam", Path(__file__).with_name("bench_beam.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_decode(model, executor, cfg, device, dtype, prompts, new, context):
    """Greedy tokens of every prompt, decoded together, and tok/s from the second step to the last (the first
    captures the CUDA graphs)."""
    b = len(prompts)
    cache = KVCache(cfg, b, context, dtype, device)
    decoder = Decoder(model, cache, executor, None, context_length=context,
                      graphs=GraphedDecode(model, cache) if graphs_wanted(device) else None)
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    tokens = {}
    start = None
    for seq, token in decoder.run([Request(p, params, tag=i) for i, p in enumerate(prompts)], batch_size=b):
        tokens[seq.request.tag] = seq.tokens
        if start is None and len(seq.tokens) == 2 and seq.row == b - 1:
            _sync(device)
            start = time.perf_counter()
    _sync(device)
    seconds = time.perf_counter() - start
    return [tokens[i] for i in range(b)], b * (new - 2) / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--gpu-budget", type=float, default=0.0, metavar="GiB",
                        help="GPU memory for resident experts (default 0: every expert in RAM)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, few tokens: checks the code runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.layers, args.device, args.new_tokens = "tiny-moe", None, "cpu", 16
        args.batches, args.acceptance, args.gammas = [1, 4], [0.5, 0.9], [1, 2, 3]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    new, max_gamma = args.new_tokens, max(args.gammas)
    context = args.prompt + new + max_gamma + 2
    model, executor, cfg, dtype = _build()(args.shape, args.layers, device, args.gpu_budget, max(context, 49))
    context = max(context, 49)

    rows, table = [], {}
    for b in args.batches:
        times = measure_step_times(model, executor, cfg, device, dtype, [b], max_gamma + 1)
        table.update({(b, int(k.split(",")[1])): ms for k, ms in times.items()})
    costs = perf_model.MeasuredCosts(table)
    fitted = None
    points = [perf_model.StepTime(b, k, ms) for (b, k), ms in table.items()]
    if len(points) >= 6:
        try:
            ridge = 300.0 if device.type == "cuda" else 30.0  # tokens where a step turns compute bound (rough)
            fit = perf_model.fit_target_times(points, cfg.num_experts, cfg.num_experts_per_tok, ridge)
            fitted = perf_model.ModelCosts(fit.model)
            print(json.dumps({"fit_rms_relative_error": round(fit.rms_relative_error, 4),
                              "fit_max_relative_error": round(fit.max_relative_error, 4)}), flush=True)
        except (ValueError, RuntimeError) as e:
            print(json.dumps({"fit": f"failed: {e}"}), flush=True)

    spec = Speculator(model, device, dtype, context)
    for b in args.batches:
        prompts = [random_prompt(args.prompt, cfg.vocab_size, 100 + i) for i in range(b)]
        references, plain_tok_s = plain_decode(model, executor, cfg, device, dtype, prompts, new, context)
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        requests = [Request(p, params) for p in prompts]
        spec.run(requests[:1], executor, oracle_factory(references, 0.0, cfg.vocab_size), draft_length=1)  # warm
        for alpha in args.acceptance:
            for gamma in args.gammas:
                done, stats = spec.run(requests, executor, oracle_factory(references, 1 - alpha, cfg.vocab_size, seed=7),
                                       mode="greedy", draft_length=gamma)
                assert [c.token_ids for c in done] == references, "speculative output differs from plain greedy"
                seconds = sum(sum(r[2:]) for r in stats.rounds) / 1000
                tok_s = sum(len(c.token_ids) - 1 for c in done) / seconds
                accepted = sum(c.stats["speculative"]["accepted"] for c in done)
                steps = sum(c.stats["speculative"]["verify_steps"] for c in done)
                measured_alpha = perf_model.acceptance_from_tokens_per_step((accepted + steps) / steps, gamma)
                row = {"batch": b, "alpha": alpha, "gamma": gamma, "plain_tok_s": round(plain_tok_s, 2),
                       "spec_tok_s": round(tok_s, 2), "speedup": round(tok_s / plain_tok_s, 3),
                       "tokens_per_step": round((accepted + steps) / steps, 3), "measured_alpha": round(measured_alpha, 3),
                       "efficiency": round(table[b, 1] / table[b, gamma + 1], 3),
                       "T_ms": {"k1": round(table[b, 1], 3), f"k{gamma + 1}": round(table[b, gamma + 1], 3)},
                       "verify_ms": stats.summary()["verify_ms"],
                       "predicted": round(perf_model.predicted_speedup(costs, b, gamma, measured_alpha), 3)}
                # the same with this run's own per-round overhead (drafting + accepting, host side) added
                overhead = sum(r[2] + r[4] for r in stats.rounds) / len(stats.rounds)
                row["predicted_with_overhead"] = round(perf_model.predicted_speedup(
                    perf_model.MeasuredCosts(table, reject=overhead), b, gamma, measured_alpha), 3)
                if fitted is not None:
                    row["predicted_fit"] = round(perf_model.predicted_speedup(fitted, b, gamma, measured_alpha), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)

    summary = {"shape": args.shape, "layers": cfg.num_layers, "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "gpu_budget_gib": args.gpu_budget, "new_tokens": new, "prompt": args.prompt,
               "best": {f"B={b},alpha={a}": max((r for r in rows if r["batch"] == b and r["alpha"] == a),
                                                key=lambda r: r["speedup"])["gamma"]
                        for b in args.batches for a in args.acceptance},
               "prediction_error": round(sum(abs(r["predicted"] / r["speedup"] - 1) for r in rows) / len(rows), 3),
               "target": "Mixtral shape, experts in RAM, B=16, alpha=0.8, gamma=4: >= 2x plain; T(16,1)/T(16,5) >= 0.7"}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
