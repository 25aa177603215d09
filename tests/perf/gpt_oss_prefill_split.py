"""Issue 41's gpt-oss prefill: the CPU kernel's rates at prefill loads, and a prefill 512 with the split priced
from them against the split priced as before. One command on the GPU box (< 300 s):

    . tests/perf/gpu_env.sh; python3 tests/perf/gpt_oss_prefill_split.py [--only kernel|bench] [--layers 8]

1. The packed CPU kernel (kernels/cpu_quant.c) on calls of 8 experts, as a prefill step's call takes them (each
   call on experts the call before did not read), at 1 / 4 / 16 / 64 tokens an expert, on the vnni path and, where
   the CPU has AMX-INT8, the amx path: MXFP4 on gpt-oss-120b's experts (H = F = 2880, its biases and clamped SwiGLU
   in the call) and Q4_K on Qwen3-30B-A3B's (H = 2048, F = 768: gpt-oss's 2880 is no whole number of Q4_K's 256).
2. `moedesk bench --shape gpt-oss-120b --layers 8 --expert-format mxfp4 --gpu-budget 0 --prefill 512` twice, each
   in a process of its own: "before" with MOEDESK_NO_PREFILL_RATES=1 (the split priced from one-expert calls and the
   lone drained copy's launch, the kernel on vnni, the CPU's call after the copies are queued), "after" as it runs by
   default (engine.offload.cpu_paths, latency_model's cpu_share and copy_launch_at, the CPU's call beside the
   copies' queueing). Each reports how many experts its prefill computed on the CPU and how many it copied, per run,
   the CPU path its profile chose and a copy's launch queued back to back at 16 tokens.

Writes $OUT/gpt_oss_prefill_split.json (OUT defaults to the current folder) and prints a short table last; the
llama.cpp figure to compare with is session 33's (docs/measurements.md): 957.4 tok/s at prefill 512.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from moedesk.kernels import cpu_quant as cq  # noqa: E402
from moedesk.kernels.expert_weights import ClampedSwiGLU, ExpertWeights  # noqa: E402

LLAMA_CPP_PREFILL_512 = 957.4  # session 33, the same shape and file on the GPU box
TOKENS = (1, 4, 16, 64)
PER_CALL = 8
CASES = {"mxfp4": ("gpt-oss-120b", 128, 2880, 2880), "q4_k": ("qwen3-30b-a3b", 128, 2048, 768)}


def _bench_cpu_quant():
    spec = importlib.util.spec_from_file_location("bench_cpu_quant", Path(__file__).with_name("bench_cpu_quant.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_rates(calls: int) -> list[dict]:
    """{format, shape, path, tokens, ms, gbs} for every case, path and token count."""
    bq = _bench_cpu_quant()
    paths = ["vnni", *(["amx"] if cq.amx_supported() else [])] if cq.vnni_supported() else ["avx2"]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt, (shape, E, H, F) in CASES.items():
        w = ExpertWeights(bq.packed_stack(fmt, E, 2 * F, H, True), bq.packed_stack(fmt, E, H, F, True), H, F, fmt, fmt)
        if shape == "gpt-oss-120b":
            w = w.with_function(torch.randn(E, 2 * F).bfloat16(), torch.randn(E, H).bfloat16(),
                                ClampedSwiGLU(alpha=1.702, limit=7.0))
        for path in paths:
            cq.set_path(path)
            for n in TOKENS:
                sec = bq.timed(lambda x, pe: cq.experts_forward_routed(x, pe, 1, None, w, torch.empty(
                    pe.numel(), H, dtype=torch.bfloat16)), bq.calls_for(E, PER_CALL, n, H, calls, gen))
                rows.append({"format": fmt, "shape": shape, "path": path, "tokens": n, "ms": sec * 1e3,
                             "gbs": PER_CALL * w.expert_bytes / sec / 1e9})
        del w
    cq.set_path(None)
    return rows


def bench(layers: int, rates: bool, timeout: int) -> dict:
    """One `moedesk bench` prefill 512 in a process of its own; its JSON report and seconds, or why it failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MOEDESK_NO_PREFILL_RATES", None)
    if not rates:
        env["MOEDESK_NO_PREFILL_RATES"] = "1"
    command = [sys.executable, "-m", "moedesk", "bench", "--shape", "gpt-oss-120b", "--layers", str(layers),
               "--expert-format", "mxfp4", "--gpu-budget", "0", "--prefill", "512", "--decode-tokens", "8",
               "--batch", "1", "--json"]
    started = time.perf_counter()
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "seconds": timeout}
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        return {"error": (run.stderr or run.stdout).strip().splitlines()[-1:], "seconds": seconds}
    report = json.loads(run.stdout[run.stdout.index("{"):])
    return {"report": report, "seconds": seconds}


def bench_row(name: str, result: dict) -> str:
    if "error" in result:
        return f"{name:<7} failed: {result['error']}"
    report = result["report"]
    r = next(x for x in report["results"] if x["mode"] == "prefill")
    e, rounds, profile = r["experts"], r["rounds"], report["profile"]
    launches = profile.get("copy_launch_prefill_ms") or {}
    return (f"{name:<7} {r['tok_s']:8.0f} {r['tok_s'] / LLAMA_CPP_PREFILL_512:6.2f}x {r['pct_of_bound'] or 0:6.0f}% "
            f"{e['experts_cpu'] / rounds:8.0f} {e['experts_copied'] / rounds:7.0f} "
            f"{profile.get('cpu_path', '-'):>6} {launches.get('16', launches.get(16, 0)):7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["kernel", "bench"], default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8, help="timed kernel calls per case")
    ap.add_argument("--timeout", type=int, default=130, help="seconds each bench process may take")
    args = ap.parse_args()
    if not cq.available():
        sys.exit(f"packed kernel unavailable: {cq.unavailable_reason()}")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cq.describe(), "amx": cq.amx_supported(), "llama_cpp_prefill_512": LLAMA_CPP_PREFILL_512}
    path = out / "gpt_oss_prefill_split.json"
    if args.only != "bench":
        result["kernel"] = kernel_rates(args.calls)
        path.write_text(json.dumps(result, indent=1))
    if args.only != "kernel":
        for name, rates in (("before", False), ("after", True)):
            print(f"bench {name} ...", flush=True)
            result[name] = bench(args.layers, rates, args.timeout)
            path.write_text(json.dumps(result, indent=1))  # what ran so far survives a stopped command
    print(f"\n{result['cpu']}; JSON in {path}")
    if "kernel" in result:
        print(f"\nCPU kernel, {PER_CALL} experts a call: GB/s of packed weights (ms a call)")
        print(f"{'format':<8}{'path':<6}" + "".join(f"{f'T={n}':>16}" for n in TOKENS))
        for fmt in CASES:
            for p in dict.fromkeys(r["path"] for r in result["kernel"]):
                cells = [r for r in result["kernel"] if r["format"] == fmt and r["path"] == p]
                print(f"{fmt:<8}{p:<6}" + "".join(f"{c['gbs']:8.1f} ({c['ms']:5.2f})" for c in cells))
    if args.only != "kernel":
        print(f"\nprefill 512, gpt-oss-120b x{args.layers}, every expert in RAM (llama.cpp {LLAMA_CPP_PREFILL_512})")
        print(f"{'run':<7} {'tok/s':>8} {'vs l.c':>7} {'bound':>7} {'CPU exp':>8} {'copied':>7} {'path':>6} "
              f"{'launch':>7}")
        for name in ("before", "after"):
            print(bench_row(name, result[name]))


if __name__ == "__main__":
    main()
