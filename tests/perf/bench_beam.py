"""Beam search W=8 against batched decode of 8 sequences, step for step, on a synthetic model of real shape.

Issue 16's target: on the Mixtral-8x7B shape with every expert in RAM, a beam step (8 hypotheses in one
forward, plus choosing the continuations and gathering the cache rows) costs at most 1.2x a batched
decode step of 8 independent sequences, measured in the same run. Both run through the same executor
and placement; the rounds alternate the two so that drift of the machine hits both alike.

    python3 tests/perf/bench_beam.py                          # Mixtral shape, 32 layers, experts in RAM
    python3 tests/perf/bench_beam.py --shape qwen3-30b-a3b --gpu-budget 8
    python3 tests/perf/bench_beam.py --smoke                  # tiny shape on the CPU: the code path only

Prints one line per measurement and a JSON summary (medians over the rounds) last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.generation.beam import BeamSearch  # noqa: E402
from engine.bench import measure_decode, random_prompt  # noqa: E402
from engine.generation.cuda_graphs import graphs_wanted  # noqa: E402


def build(shape: str, layers: int | None, device: torch.device, gpu_budget_gib: float, context: int):
    """The synthetic model with its experts profiled, calibrated and placed as `moedesk bench` does."""
    from engine.load.demo import cache_root
    from engine.offload.orchestration import ExpertOrchestra, leave_a_core_to_the_gpu_thread
    from engine.load.synthetic import shape_config, synthetic_model

    on_cuda = device.type == "cuda"
    if on_cuda:
        leave_a_core_to_the_gpu_thread()
    dtype = torch.bfloat16 if on_cuda else torch.float32
    cfg = shape_config(shape, layers)
    model, banks = synthetic_model(cfg, dtype, device, pinned=on_cuda, context=context)
    key = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, str(dtype))
    orchestra = ExpertOrchestra.start(banks, device, ("bench", key), cache_root(), reprofile=True,
                                      top_k=cfg.num_experts_per_tok, dtype=dtype)
    executor = orchestra.executor
    halves = []
    for seed in (1000, 2000):  # popularity as `moedesk bench` calibrates it, on prompts apart from the measured
        executor.selections.clear()
        measure_decode(model, executor, cfg, device, dtype, 4, new_tokens=16, prompt=32, seed=seed)
        halves.append([executor.selections[layer].tolist() for layer in sorted(banks)])
    orchestra.calibrate(halves)
    on_gpu = orchestra.place(int(gpu_budget_gib * 2**30)).as_lists()
    print(f"{shape} x{cfg.num_layers} layers on {device} {dtype}: {sum(map(sum, on_gpu))} of "
          f"{len(banks) * cfg.num_experts} experts on the GPU", flush=True)
    return model, executor, cfg, dtype


def active_per_step(stats, steps: int) -> float:
    return round((stats.gpu_experts + stats.cpu_experts + stats.copied_experts + stats.streamed_experts) / steps, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (default: all)")
    parser.add_argument("--gpu-budget", type=float, default=0.0, metavar="GiB",
                        help="GPU memory for resident experts (default 0: every expert in RAM)")
    parser.add_argument("--beams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, few tokens: checks the code runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.layers, args.device, args.new_tokens, args.rounds = "tiny-moe", None, "cpu", 8, 1
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    W, new, prompt = args.beams, args.new_tokens, args.prompt
    context = max(prompt + new + 1, 32 + 16 + 1)  # the calibration's decode runs 16 tokens past 32
    model, executor, cfg, dtype = build(args.shape, args.layers, device, args.gpu_budget, context)

    beam = BeamSearch(model, device, dtype, context, graphs=graphs_wanted(device))
    beam.reserve(W, prompt + new)  # the warm-up below then captures the graphs of the cache the timed runs use
    warm = random_prompt(prompt, cfg.vocab_size, 99)
    beam.run(warm, executor, W, 3)

    batched_ms, beam_ms, rows = [], [], []
    for r in range(args.rounds):
        # Batched decode: timed from its second step to its last (the first captures its graphs).
        result = measure_decode(model, executor, cfg, device, dtype, W, new_tokens=new, prompt=prompt, seed=10 * r)
        steps = new - 2
        batched_ms.append(1000 * result.seconds / steps)
        batched_active = active_per_step(executor.stats, steps)

        # Beam search: no EOS, so it runs every step; its steps include choosing and gathering cache rows.
        executor.stats = type(executor.stats)()
        started = time.perf_counter()
        found = beam.run(random_prompt(prompt, cfg.vocab_size, 10 * r + 5), executor, W, new)
        total = time.perf_counter() - started
        beam_ms.append(1000 * found.decode_s / found.steps)
        beam_active = active_per_step(executor.stats, found.steps + 1)  # the prefill counted in the stats too
        row = {"round": r, "batched_step_ms": round(batched_ms[-1], 3), "beam_step_ms": round(beam_ms[-1], 3),
               "ratio": round(beam_ms[-1] / batched_ms[-1], 3), "beam_steps": found.steps,
               "beam_prefill_ms": round(1000 * found.prefill_s, 2), "beam_total_s": round(total, 3),
               "experts_per_step": {"batched": batched_active, "beam": beam_active}}
        rows.append(row)
        print(json.dumps(row), flush=True)

    summary = {"shape": args.shape, "layers": cfg.num_layers, "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "gpu_budget_gib": args.gpu_budget, "beams": W, "new_tokens": new,
               "prompt": prompt, "graphs": beam.graphs is not None and beam.graphs.broken is None,
               "batched_step_ms": round(statistics.median(batched_ms), 3),
               "beam_step_ms": round(statistics.median(beam_ms), 3)}
    summary["ratio"] = round(summary["beam_step_ms"] / summary["batched_step_ms"], 3)
    summary["target"] = "beam step <= 1.2x batched decode step (issue 16)"
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
