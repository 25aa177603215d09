"""Where a decode step's GPU time goes with every expert resident, kernel class by kernel class, beside llama.cpp.

Usage (GPU box, repo root): python3 tests/perf/profile_gpu_decode.py [SHAPE:LAYERS] [--expert-format q4_k]
    [--batch 1] [--steps 16] [--llama-bench PATH] [--timeline FILE]
(The non-expert weights are packed as a GGUF of --expert-format keeps them, engine.load.synthetic.packed_plan;
MOEDESK_PACKED_WEIGHTS=0 in front: in 16 bits.)
Every expert resident on one GPU: the floor the GPU's own kernels set, where issue 45's second target (two GPUs
against llama.cpp with every expert on them) is decided. Decode with CUDA graphs as the engine runs it, then
torch.profiler over two decode runs that differ only in length, so prefill and graph capture cancel: GPU ms a step
per kernel class (packed experts, dense GEMMs, attention, routing, copies, the rest), and what the packed experts
and the dense weights were read at (the bytes a step reads once each, over the class's time). With --llama-bench,
llama-bench on the same shape's GGUF (bench.synthetic_gguf, llama.cpp's quantiser: attention weights quantised
too) with every layer and expert on the GPU, in the same run. With --timeline FILE, the last decode step's kernels
in order, each with the GPU's idle time before it (where the host holds the step up), and the longest by name.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.bench.synthetic import measure_decode  # noqa: E402
from moedesk.engine.load.synthetic import shape_config, synthetic_model  # noqa: E402
from moedesk.engine.model.packed_linear import PackedLinear  # noqa: E402
from moedesk.engine.offload.offload_executor import OffloadExecutor  # noqa: E402

# First match wins; names as Triton, cuBLAS and torch give their kernels.
CLASSES = [("packed experts", r"_packed_mm|_q8_mm|_q8_rows"),
           ("attention", r"attention|attn|flash|sdpa|_combine|_write_cache|rotary|rope"),
           ("dense GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|sm90_"),
           ("routing", r"route|topk|top_k|softmax|sort"),
           ("copies", r"memcpy|memset|copy")]


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "the rest"


def gpu_ms_by_class(run, trace: str | None = None) -> dict[str, float]:
    """GPU ms by kernel class over one call of `run`; trace: a path the profile is also written to (Chrome's
    format), for `kernels_of`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = event.self_cuda_time_total
        if us:
            label = kernel_class(event.key)
            totals[label] = totals.get(label, 0.0) + us / 1e3
    return totals


def kernels_of(trace: dict) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every kernel, copy and memset a Chrome trace holds, by start."""
    return sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in trace.get("traceEvents", ())
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)


def last_step(kernels: list[tuple[float, float, str]], per_step: int) -> list[tuple[float, float, float, str]]:
    """The last `per_step` kernels as one step's timeline: (µs from the step's first start, duration µs, idle µs
    before it since the previous kernel ended, name)."""
    step = kernels[-per_step:] if per_step > 0 else []
    rows, end = [], None
    for start, dur, name in step:
        rows.append((start - step[0][0], dur, 0.0 if end is None else max(0.0, start - end), name))
        end = start + dur if end is None else max(end, start + dur)
    return rows


def timeline_lines(rows: list[tuple[float, float, float, str]], top: int = 8) -> list[str]:
    """A step's timeline in a few lines: its span against the GPU's busy time, the idle gaps, the longest kernels
    (name, class, µs: where a class's time sits)."""
    if not rows:
        return ["  (no kernels in the step)"]
    span = rows[-1][0] + rows[-1][1]
    busy, idle = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [f"  one step: {len(rows)} kernels over {span:.1f} µs, busy {busy:.1f} µs, idle between them "
             f"{idle:.1f} µs ({sum(r[2] > 5 for r in rows)} gaps over 5 µs)"]
    by_name: dict[str, list[float]] = {}
    for _, dur, _, name in rows:
        by_name.setdefault(name, []).append(dur)
    for name, durs in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]:
        lines.append(f"    {sum(durs):8.1f} µs in {len(durs):3d} launches ({kernel_class(name)}): {name[:70]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", nargs="?", default="mixtral-8x7b:8")
    parser.add_argument("--expert-format", default="q4_k")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16, help="decode steps the two profiled runs differ by")
    parser.add_argument("--llama-bench", help="llama-bench to run on the same shape's GGUF, every layer on the GPU")
    parser.add_argument("--timeline", help="write the last decode step's kernels here, one a line (start, duration "
                                           "and idle µs before it, class, name), and print its summary")
    args = parser.parse_args()
    name, layers = args.shape.split(":")
    device = torch.device("cuda")
    cfg = shape_config(name, int(layers))
    model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256,
                                   expert_format=args.expert_format)
    executor = OffloadExecutor(banks, [[True] * cfg.num_experts for _ in banks], device,
                               lambda loads: (sorted(loads), []))

    def decode(tokens: int):
        return measure_decode(model, executor, cfg, device, torch.bfloat16, args.batch, tokens)

    decode(8)  # compiles the kernels
    rate = decode(64)
    trace = f"{args.timeline}.trace.json" if args.timeline else None
    short = gpu_ms_by_class(lambda: decode(8), trace and f"{trace}.short")
    long = gpu_ms_by_class(lambda: decode(8 + args.steps), trace)
    per_step = {label: (long.get(label, 0.0) - short.get(label, 0.0)) / args.steps for label in long}
    gpu_ms = sum(per_step.values())
    print(f"{args.shape} {args.expert_format}, batch {args.batch}, every expert on the GPU: {rate.tok_s:.1f} tok/s, "
          f"{1e3 * args.batch / rate.tok_s:.2f} ms a step, of which {gpu_ms:.2f} ms in GPU kernels")
    moe_layers = len(banks)
    expert_bytes = sum(w.gate_up.nbytes + w.down.nbytes for w in banks.values()) // (cfg.num_experts * moe_layers)
    touched = moe_layers * min(cfg.num_experts, cfg.num_experts_per_tok * args.batch)  # at most; one row reads top_k
    dense_bytes = sum(p.nbytes for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    # The non-expert weights kept packed run the experts' kernel (_packed_mm) too
    packed_weights = sum(m.packed.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    if packed_weights:
        print(f"  (packed non-expert weights: {packed_weights / 1e9:.2f} GB a step, in the packed experts' class)")
    read = {"packed experts": touched * expert_bytes + packed_weights, "dense GEMM": dense_bytes}
    for label, ms in sorted(per_step.items(), key=lambda item: -item[1]):
        rate_text = f", {read[label] / ms / 1e6:7.0f} GB/s of {read[label] / 1e9:.2f} GB" if label in read and ms else ""
        print(f"  {label:<15} {ms:7.3f} ms a step ({100 * ms / gpu_ms:4.1f}%){rate_text}")
    if args.timeline:
        write_timeline(trace, args.timeline, args.steps)
    if args.llama_bench:
        from moedesk.bench.synthetic_gguf import shape_gguf
        from moedesk.engine.load.demo import cache_root

        gguf = shape_gguf(cfg, name, args.expert_format, cache_root() / "bench-gguf")
        done = subprocess.run([args.llama_bench, "-m", str(gguf), "-ngl", "99", "-ncmoe", "0", "-fa", "1", "-p", "0",
                               "-n", "64", "-r", "3", "-o", "json"],
                              capture_output=True, text=True, check=True)
        theirs = json.loads(done.stdout)[0]["avg_ts"]
        print(f"llama-bench -ngl 99 -ncmoe 0 on {gguf.name}: decode {theirs:.1f} tok/s; ours over it "
              f"{rate.tok_s / theirs:.2f}x" + ("" if args.batch == 1 else " (llama-bench decodes one sequence)"))


def write_timeline(trace: str, path: str, steps: int) -> None:
    """The last step of the long run (`trace`; the short run's beside it, `.short`) to `path`, and its summary
    printed. A step's kernels: the long run's less the short run's, per step."""
    with open(f"{trace}.short") as f:
        short = len(kernels_of(json.load(f)))
    with open(trace) as f:
        kernels = kernels_of(json.load(f))
    rows = last_step(kernels, (len(kernels) - short) // steps)
    with open(path, "w") as f:
        for offset, dur, gap, name in rows:
            f.write(f"{offset:9.1f}\t{dur:8.1f}\t{gap:7.1f}\t{kernel_class(name)}\t{name}\n")
    print("\n".join(timeline_lines(rows)))


if __name__ == "__main__":
    main()
