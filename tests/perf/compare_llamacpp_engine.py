"""moedesk's llama.cpp engine against llama-bench on the same GGUF, in one run (GPU box; llama-cpp-python built with
CUDA: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python).

Usage (repo root):
    python3 tests/perf/compare_llamacpp_engine.py --llama-bench PATH/llama-bench [--gguf FILE | --shape mixtral-8x7b
        --layers 8 --expert-format q4_k] [--ncmoe N] [--budgets 8,16,24] [--threads 16] [--json OUT.json]

The issue's targets (#40), each printed with its ratio:
- wrapper: decode (tg64) and prefill (pp512) through moedesk's engine with `--ncmoe N` layers' experts in RAM,
  over llama-bench `-ngl 99 -ncmoe N` on the same file (target >= 0.95x), with the engine counting the routers'
  picks as the app does, and again without (what counting costs);
- placement: for each GPU budget (GB of GPU memory for the whole model: weights, KV cache), llama-bench's decode
  at every -ncmoe that fits it (the sweep), and moedesk's automatic placement at that budget (the N it chose and
  its decode) over the best of the sweep (target >= 0.95x). What fits: the non-expert tensors, the experts of
  the layers from N on and the KV cache within the budget (less a 1 GiB margin for llama.cpp's compute buffers).
Without --gguf the shape is written as a GGUF once (bench/synthetic_gguf.py, cached). A gpt-oss-120b-shape MXFP4
file (first 8 layers) is not written here: pass one with --gguf. Four concurrent streams through serve:
tests/perf/bench_serve.py --model FILE --engine llama.cpp --clients 4 (its "over one client" line).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GIB = 2**30
MARGIN = GIB  # llama.cpp's compute buffers and the CUDA context, beside the weights and the KV cache


def llama_bench(binary: str, gguf: str, ncmoe: int, threads: int, prompt: int, tokens: int) -> dict:
    """{"pp": tok/s of a prompt of `prompt` tokens, "tg": tok/s of `tokens` generated} from llama-bench's JSON."""
    # -fa 1: the engine keeps llama.cpp's own default, auto, which takes flash attention where it can (its
    # graph runs FLASH_ATTN_EXT); llama-bench is told the same.
    out = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-ncmoe", str(ncmoe), "-t", str(threads), "-fa", "1",
                          "-p", str(prompt), "-n", str(tokens), "-r", "2", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rates = {}
    for row in json.loads(out):
        key = "pp" if row.get("n_prompt") and not row.get("n_gen") else "tg"
        rates[key] = float(row["avg_ts"])
    return rates


def ours(gguf: str, ncmoe: int | None, budget_gib: float | None, prompt: int, tokens: int, threads: int,
         count_experts: bool = True) -> dict:
    import torch

    from moedesk.bench.llamacpp import measure
    from moedesk.engine.llamacpp.engine import LlamaCppEngine

    torch.set_num_threads(threads)  # the engine runs as many threads as torch: llama-bench's -t
    engine = LlamaCppEngine.load(gguf, context_length=max(prompt, tokens + 32) + 64, cpu_moe=ncmoe,
                                 gpu_budget=budget_gib, count_experts=count_experts)
    try:
        report = measure(engine, tokens, (prompt,), batch=1, log=lambda *a: None)
    finally:
        engine.close()
    rates = {r["mode"]: r["tok_s"] for r in report["results"]}
    return {"pp": rates["prefill"], "tg": rates["decode"], "ncmoe": engine.placement.cpu_moe,
            "why": engine.placement.why, "warnings": report["warnings"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench, built with CUDA")
    parser.add_argument("--gguf", default=None, help="the file to compare on (default: the shape below, written)")
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--expert-format", default="q4_k", help="q4_k is what a Q4_K_M file holds")
    parser.add_argument("--ncmoe", type=int, default=None, help="the wrapper comparison's -ncmoe (default: all layers)")
    parser.add_argument("--budgets", default="8,16,24", help="GPU budgets in GB for the placement sweep")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from gguf import GGUFReader

    from moedesk.engine.llamacpp.placement import cpu_moe_layers, gguf_sizes

    gguf = args.gguf
    if gguf is None:
        from moedesk.bench.synthetic_gguf import shape_gguf
        from moedesk.engine.load.demo import cache_root
        from moedesk.engine.load.synthetic import shape_config

        gguf = str(shape_gguf(shape_config(args.shape, args.layers), args.shape, args.expert_format,
                              cache_root() / "bench-gguf"))
    reader = GGUFReader(gguf)
    sizes = gguf_sizes((t.name, int(t.n_bytes)) for t in reader.tensors)
    layers = len(sizes.expert_bytes)
    report = {"gguf": gguf, "expert_gib_per_layer": round(sizes.expert_bytes[0] / GIB, 3),
              "other_gib": round(sizes.other_bytes / GIB, 3)}

    n = layers if args.ncmoe is None else args.ncmoe
    theirs = llama_bench(args.llama_bench, gguf, n, args.threads, args.prompt, args.tokens)
    # The engine as the app runs it counts the routers' picks (the heat map): its cost is the second line.
    for label, count in (("wrapper", True), ("wrapper_uncounted", False)):
        mine = ours(gguf, n, None, args.prompt, args.tokens, args.threads, count_experts=count)
        report[label] = {"ncmoe": n, "llama_bench": theirs, "moedesk": mine, "expert_counts": count,
                         "decode_ratio": round(mine["tg"] / theirs["tg"], 3),
                         "prefill_ratio": round(mine["pp"] / theirs["pp"], 3)}
        print(f"{label}, -ncmoe {n}, expert counts {'on' if count else 'off'}: decode {mine['tg']:.1f} vs llama-bench "
              f"{theirs['tg']:.1f} tok/s = {report[label]['decode_ratio']:.3f}x; prefill {args.prompt} "
              f"{mine['pp']:.1f} vs {theirs['pp']:.1f} = {report[label]['prefill_ratio']:.3f}x (target >= 0.95x)")

    kv = 0  # the short context of these runs: its KV cache is within the margin
    report["placement"] = []
    for budget_gb in (float(b) for b in args.budgets.split(",")):
        budget = int(budget_gb * 1e9)
        expert_room = budget - sizes.other_bytes - kv - MARGIN
        if expert_room < 0:
            print(f"budget {budget_gb:g} GB: the non-expert weights alone do not fit")
            continue
        fewest = cpu_moe_layers(sizes.expert_bytes, expert_room)
        sweep = {m: llama_bench(args.llama_bench, gguf, m, args.threads, args.prompt, args.tokens)["tg"]
                 for m in range(fewest, layers + 1)}
        best = max(sweep, key=sweep.get)
        auto = ours(gguf, None, expert_room / GIB, args.prompt, args.tokens, args.threads)
        ratio = auto["tg"] / sweep[best]
        report["placement"].append({"budget_gb": budget_gb, "sweep_tg": sweep, "best_ncmoe": best,
                                    "auto_ncmoe": auto["ncmoe"], "auto_tg": auto["tg"], "ratio": round(ratio, 3)})
        print(f"budget {budget_gb:g} GB: llama-bench decode by -ncmoe {sweep}; best -ncmoe {best} "
              f"{sweep[best]:.1f} tok/s; moedesk chose {auto['ncmoe']} ({auto['why']}): {auto['tg']:.1f} tok/s = "
              f"{ratio:.3f}x (target >= 0.95x)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
