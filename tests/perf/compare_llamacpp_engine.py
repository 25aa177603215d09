"""moedesk's llama.cpp engine against llama-bench on the same GGUF, in one run (GPU box; llama-cpp-python built with
CUDA: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python).

Usage (repo root):
    python3 tests/perf/compare_llamacpp_engine.py --llama-bench PATH/llama-bench [--gguf FILE | --shape mixtral-8x7b
        --layers 8 --expert-format q4_k] [--ncmoe N] [--budgets 8,16,24] [--threads 16] [--reps 5]
        [--batched-bench PATH/llama-batched-bench] [--placement-only] [--sweep-span N] [--json OUT.json]

The issue's targets (#40), each printed with its ratio:
- wrapper: decode (tg64) and prefill (pp512) through moedesk's engine with `--ncmoe N` layers' experts in RAM,
  over llama-bench `-ngl 99 -ncmoe N` on the same file (target >= 0.95x), with the engine counting the routers'
  picks as the app does (prompts whole, one decode step in COUNT_EVERY), and again without (what counting
  costs); `--count-every 8,1` adds a line per further value (1: every step counted, as before issue 40's sample);
- placement: for each GPU budget (GB of GPU memory for the whole model), llama-bench's decode at every -ncmoe that
  fits it (the sweep), and moedesk's automatic placement given that same budget (`--gpu-budget`, the whole GPU's:
  the N it chose and its decode, the median of --reps runs, then again with the expert counts off) over the best
  of the sweep (target >= 0.95x). What fits is llama.cpp's own
  account: the model, KV and compute buffers it reports on the GPU when the engine loads the file with -ncmoe N at
  the comparison's context, within the budget (each N's figures are printed beside moedesk's estimate of them).
The whole Mixtral shape at the issue's budgets, placement alone: --layers 32 --budgets 8,16,24 --placement-only
--sweep-span 2. Without --gguf the shape is written as a GGUF once (bench/synthetic_gguf.py, cached). A gpt-oss-120b-shape MXFP4
file (first 8 layers) is not written here: pass one with --gguf. Four concurrent streams through serve:
tests/perf/bench_serve.py --model FILE --engine llama.cpp --clients 4 (its "over one client" line); llama.cpp's own
1 and 4 sequences beside it with --batched-bench.
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


def llama_bench(binary: str, gguf: str, ncmoe: int, threads: int, prompt: int, tokens: int, reps: int = 2,
                extra: tuple[str, ...] = ()) -> dict:
    """{"pp": tok/s of a prompt of `prompt` tokens, "tg": tok/s of `tokens` generated} from llama-bench's JSON, the
    mean of `reps` runs. extra: more of llama-bench's options (`-lm none`: the file read, not mapped)."""
    # -fa 1: the engine keeps llama.cpp's own default, auto, which takes flash attention where it can (its
    # graph runs FLASH_ATTN_EXT); llama-bench is told the same.
    out = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-ncmoe", str(ncmoe), "-t", str(threads), "-fa", "1",
                          "-p", str(prompt), "-n", str(tokens), "-r", str(reps), "-o", "json", *extra],
                         check=True, capture_output=True, text=True).stdout
    rates = {}
    for row in json.loads(out):
        key = "pp" if row.get("n_prompt") and not row.get("n_gen") else "tg"
        rates[key] = float(row["avg_ts"])
    return rates


def batched_bench(binary: str, gguf: str, threads: int, prompt: int = 128, tokens: int = 64,
                  parallel: tuple[int, ...] = (1, 4)) -> dict[int, float]:
    """llama.cpp's own batched decode with every layer on the GPU (-ngl 99, as serve's 10 GiB budget places the
    file): {sequences: their decode tok/s together} from llama-batched-bench, each sequence its own prompt of
    `prompt` tokens and its own stream of cells (serve's), then `tokens` steps of all of them."""
    out = subprocess.run([binary, "-m", gguf, "-ngl", "99", "-fa", "on", "-t", str(threads),
                          "-c", str(max(parallel) * (prompt + tokens)), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(tokens), "-npl", ",".join(map(str, parallel)),
                          "--output-format", "jsonl"], check=True, capture_output=True, text=True)
    return batched_rates(out.stdout + "\n" + out.stderr)


def batched_rates(text: str) -> dict[int, float]:
    """{sequences (pl): decode tok/s of them all (speed_tg)} from llama-batched-bench's JSONL lines in `text`."""
    rates = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "pl" in row and "speed_tg" in row:
            rates[int(row["pl"])] = float(row["speed_tg"])
    return rates


def batched_line(rates: dict[int, float], prompt: int, tokens: int) -> str:
    """The comparison's line for llama-batched-bench's rates: each count of sequences, and the most over one."""
    if 1 not in rates or len(rates) < 2:
        return f"llama-batched-bench gave no rates for one sequence and more: {rates}"
    most = max(rates)
    each = ", ".join(f"{n} {'sequence' if n == 1 else 'sequences'} {rate:.1f}" for n, rate in sorted(rates.items()))
    return (f"llama-batched-bench -ngl 99 -npp {prompt} -ntg {tokens}: decode {each} tok/s; {most} over one "
            f"{rates[most] / rates[1]:.2f}x (beside serve's own decode steps, 4 clients over 1)")


def context_for(prompt: int, tokens: int) -> int:
    return max(prompt, tokens + 32) + 64


def loaded(gguf: str, ncmoe: int | None, budget_gib: float | None, context: int, threads: int,
           count_experts: bool = True):
    """moedesk's llama.cpp engine on the file, and what llama.cpp reported on the GPU while loading it:
    {"model", "KV", "compute"} bytes (engine.llamacpp.buffers)."""
    import torch

    from moedesk.engine.llamacpp.buffers import llama_buffers, on_device
    from moedesk.engine.llamacpp.engine import LlamaCppEngine
    from moedesk.engine.llamacpp.library import library

    torch.set_num_threads(threads)  # the engine runs as many threads as torch: llama-bench's -t
    mark = library().log_mark()
    engine = LlamaCppEngine.load(gguf, context_length=context, cpu_moe=ncmoe, gpu_budget=budget_gib,
                                 count_experts=count_experts)
    return engine, on_device(llama_buffers(library().log_since(mark)))


def ours(gguf: str, ncmoe: int | None, budget_gib: float | None, prompt: int, tokens: int, threads: int,
         count_experts: bool = True, decodes: int = 1) -> dict:
    """decodes: the decode measured this many times on the one load (the same prompt each time), "tg" their median
    and "tg_runs" each: one run of 64 tokens moves by a few percent from one to the next."""
    import statistics

    from moedesk.bench.llamacpp import _prompt, measure
    from moedesk.engine.requests import Request, SamplingParams

    engine, gpu = loaded(gguf, ncmoe, budget_gib, context_for(prompt, tokens), threads, count_experts)
    try:
        # The prompt twice: llama-bench times its prompt after a warm-up run of the same size, and a context's first
        # prompt of a size pays once for what that size needs (kernels loaded on first use, the graph built).
        report = measure(engine, tokens, (prompt, prompt), batch=1, log=lambda *a: None)
        prefills = [r["tok_s"] for r in report["results"] if r["mode"] == "prefill"]
        rates = {r["mode"]: r["tok_s"] for r in report["results"]}  # the prefill: the second, warm run
        runs = [rates["decode"]]
        for _ in range(decodes - 1):  # as measure's decode: 32 prompt tokens, greedy, to the last token
            done = engine.complete([Request(_prompt(32, engine.vocab_size, 0),
                                            SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True))])
            runs.append(done[0].stats["decode_tok_s"])
        # The bare loops run on threads of their own that end with them, as the engine's decode thread does. Never
        # on this process's main thread: llama.cpp's OpenMP team there would outlive the loop, and while a second
        # thread's team lives, every later decode thread's runs at a fraction of its speed (libgomp throttles its
        # waits once more threads than cores are its own: docs/measurements.md, "Session 46").
        bare = sorted(on_new_thread(lambda: bare_decode(engine, tokens))
                      for _ in range(decodes))[(decodes - 1) // 2] if decodes > 1 else None
        prefill_bare = on_new_thread(lambda: bare_prefill(engine, prompt, tokens, threads)) if decodes > 1 else None
    finally:
        engine.close()
    return {"pp": rates["prefill"], "pp_runs": prefills, "tg": statistics.median(runs), "tg_runs": runs, "tg_bare": bare,
            "pp_bare": prefill_bare, "ncmoe": engine.placement.cpu_moe,
            "why": engine.placement.why, "warnings": report["warnings"], "gpu_bytes": sum(gpu.values())}


def on_new_thread(work):
    """work()'s result, run on a thread of its own that ends with it (as the scheduler's decode thread)."""
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the work on its own thread failed (its traceback is above)")
    return out[0]


def fill(batch, ids: list[int], start: int) -> None:
    """A llama_batch of sequence 0's `ids` at positions from `start`, the last one's logits wanted."""
    for j, token in enumerate(ids):
        batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, start + j, 1, j == len(ids) - 1
        batch.seq_id[j][0] = 0
    batch.n_tokens = len(ids)


def bare_decode(engine, tokens: int) -> float:
    """tok/s of a bare loop on the engine's own llama.cpp context: llama_decode of one token, then its logits read
    (the argmax its next token), `tokens` times after a 32-token prompt, as measure's decode runs. What is left
    between this and llama-bench is the process (torch beside llama.cpp), not the wrapper's Python."""
    import ctypes
    import time

    import numpy as np

    from moedesk.bench.llamacpp import _prompt

    llama, api = engine.llama, engine.api
    batch, prompt = llama.batch, _prompt(32, engine.vocab_size, 0)
    api.llama_memory_seq_rm(api.llama_get_memory(llama.ctx), 0, -1, -1)

    def step(ids, start):
        fill(batch, ids, start)
        if llama.counter is not None:  # counted as the engine's steps are: a prompt whole, one decode step in N
            llama.counter.begin_step(len(ids) > 1)
        if api.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        row = ctypes.cast(api.llama_get_logits_ith(llama.ctx, len(ids) - 1), ctypes.POINTER(ctypes.c_float))
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(llama.n_vocab,))))

    token = step(prompt, 0)
    token = step([token], len(prompt))  # timed from the second token, as decode_tok_s is
    start = time.perf_counter()
    for i in range(tokens - 1):
        token = step([token], len(prompt) + 1 + i)
    rate = (tokens - 1) / (time.perf_counter() - start)
    api.llama_memory_seq_rm(api.llama_get_memory(llama.ctx), 0, -1, -1)
    return round(rate, 2)


def bare_prefill(engine, prompt: int, tokens: int, threads: int, runs: int = 3) -> dict:
    """tok/s of one llama_decode of a `prompt`-token prompt (the median of `runs`, after one of the same size), on
    the engine's own context and on a second context over the same model made as llama-bench makes its own (one
    sequence, prompt + tokens positions, the sliding-window cache only as long as its window): the first against
    the wrapper's prefill is the wrapper's Python; the second against the first is the context's settings."""
    import statistics
    import time

    from moedesk.bench.llamacpp import _prompt

    api, llama = engine.api, engine.llama
    ids = _prompt(prompt, engine.vocab_size, prompt)

    def timed(ctx, batch) -> float:
        rates = []
        for _ in range(runs + 1):
            api.llama_memory_seq_rm(api.llama_get_memory(ctx), 0, -1, -1)
            fill(batch, ids, 0)
            if llama.counter is not None:
                llama.counter.begin_step(True)
            start = time.perf_counter()
            if api.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            api.llama_get_logits_ith(ctx, len(ids) - 1)  # llama_decode returns once the logits are read back
            rates.append(prompt / (time.perf_counter() - start))
        api.llama_memory_seq_rm(api.llama_get_memory(ctx), 0, -1, -1)
        return round(statistics.median(rates[1:]), 1)

    found = {"engine_context": timed(llama.ctx, llama.batch)}
    params = api.llama_context_default_params()  # llama-bench's to_llama_cparams
    params.n_ctx, params.n_batch, params.n_ubatch = prompt + tokens, 2048, 512
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type, params.swa_full = 1, False  # -fa 1, as llama_bench() runs it
    ctx = api.llama_init_from_model(llama.model, params)
    if not ctx:
        return {**found, "bench_context": None}
    batch = api.llama_batch_init(max(prompt, 1), 0, 1)
    try:
        found["bench_context"] = timed(ctx, batch)
    finally:
        api.llama_batch_free(batch)
        api.llama_free(ctx)
    return found


def swept_enough(found: dict[int, dict], budgets: list[int], span: int) -> bool:
    """Whether `found` (needs' entries so far, -ncmoe ascending) holds the `span` + 1 least -ncmoe values that fit
    each budget (bytes): all that --sweep-span times, so larger ones need no load."""
    return all(sum(f["llama_cpp"]["total"] <= budget for f in found.values()) > span for budget in budgets)


def needs(gguf: str, shape, most: int, context: int, threads: int, budgets: list[int] = (),
          span: int | None = None) -> dict[int, dict]:
    """For every -ncmoe N: what llama.cpp reports on the GPU with the engine loaded that way ("llama_cpp": model, KV,
    a hybrid model's recurrent state (RS), compute and their total), beside moedesk's estimate of the same
    (fit.gpu_bytes, fit.compute_bytes). An N whose weights alone exceed `most` bytes is not loaded (its total is
    those weights). With a `span`, it stops once the sweep of each of `budgets` has its values (`swept_enough`):
    each load reads the whole file, about ten seconds for a whole Mixtral."""
    found = {}
    for n in range(len(shape.sizes.expert_bytes) + 1):
        if span is not None and swept_enough(found, budgets, span):
            break
        weights = shape.other_on_gpu + sum(shape.sizes.expert_bytes[n:])
        if weights > most:
            found[n] = {"llama_cpp": {"total": weights, "not_loaded": True}}
            continue
        engine, gpu = loaded(gguf, n, None, context, threads, count_experts=False)
        fit = engine.fit
        engine.close()
        found[n] = {"llama_cpp": {**gpu, "total": sum(gpu.values())},
                    "estimate": {"weights_kv_rs": fit.gpu_bytes, "compute": fit.compute_bytes,
                                 "total": fit.gpu_total}}
        mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
        print(f"-ncmoe {n}: llama.cpp on the GPU model {mib(gpu.get('model', 0))} + KV {mib(gpu.get('KV', 0))} + "
              f"RS {mib(gpu.get('RS', 0))} + compute {mib(gpu.get('compute', 0))} = {mib(sum(gpu.values()))} MiB; "
              f"moedesk's estimate weights+KV+RS {mib(fit.gpu_bytes)} + compute {mib(fit.compute_bytes)} = "
              f"{mib(fit.gpu_total)} MiB")
    return found


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
    parser.add_argument("--count-every", default=None,
                        help="count one decode step in this many, comma-separated: the first for the wrapper line, "
                             "each further one a line of its own (default: the engine's COUNT_EVERY)")
    parser.add_argument("--reps", type=int, default=5,
                        help="llama-bench's -r, and the engine's decode runs per load (their median); llama-bench "
                             "runs before and after the engine's lines, so a drift between the two shows")
    parser.add_argument("--batched-bench", default=None,
                        help="llama.cpp's llama-batched-bench: a line of its decode at 1 and 4 sequences, every layer "
                             "on the GPU (what serve's four clients are compared with)")
    parser.add_argument("--placement-only", action="store_true",
                        help="only the placement sweep (the wrapper lines at every layer's experts in RAM take long "
                             "on a whole model)")
    parser.add_argument("--sweep-span", type=int, default=None,
                        help="time only the N fitting -ncmoe values above the least that fits (default: every one; "
                             "more experts in RAM never decoded faster in any sweep so far)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from moedesk.engine.llamacpp import expert_counts

    try:
        count_everies = [int(e) for e in args.count_every.split(",")] if args.count_every \
            else [expert_counts.COUNT_EVERY]
    except ValueError:
        count_everies = []
    if not count_everies or min(count_everies) < 1:
        parser.error(f"--count-every {args.count_every!r}: expected whole numbers >= 1 separated by commas, e.g. 8,1,32")

    from gguf import GGUFReader

    from moedesk.engine.llamacpp.fit import gguf_shape

    gguf = args.gguf
    if gguf is None:
        from moedesk.bench.synthetic_gguf import shape_gguf
        from moedesk.engine.load.demo import cache_root
        from moedesk.engine.load.synthetic import shape_config

        gguf = str(shape_gguf(shape_config(args.shape, args.layers), args.shape, args.expert_format,
                              cache_root() / "bench-gguf"))
    shape = gguf_shape(GGUFReader(gguf))
    sizes = shape.sizes
    layers = len(sizes.expert_bytes)
    report = {"gguf": gguf, "expert_gib_per_layer": round(sizes.expert_bytes[0] / GIB, 3),
              "other_gib": round(sizes.other_bytes / GIB, 3)}

    if not args.placement_only:
        wrapper_lines(args, gguf, layers, count_everies, report)
    expert_counts.COUNT_EVERY = count_everies[0]  # the placement runs below count as the wrapper line does
    placement_lines(args, gguf, shape, report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def wrapper_lines(args, gguf: str, layers: int, count_everies: list[int], report: dict) -> None:
    """Decode and prefill through the engine over llama-bench at the same -ncmoe, with and without counting."""
    from moedesk.engine.llamacpp import expert_counts

    n = layers if args.ncmoe is None else args.ncmoe
    theirs = before = llama_bench(args.llama_bench, gguf, n, args.threads, args.prompt, args.tokens, args.reps)
    # The engine as the app runs it counts the routers' picks (the heat map): its cost is the second line.
    runs = [("wrapper", count_everies[0]), ("wrapper_uncounted", None)]
    runs += [(f"wrapper_count_every_{e}", e) for e in count_everies[1:]]
    for label, count_every in runs:
        if count_every is not None:
            expert_counts.COUNT_EVERY = count_every  # read by each counter the engine makes
        mine = ours(gguf, n, None, args.prompt, args.tokens, args.threads, count_experts=count_every is not None,
                    decodes=args.reps)
        report[label] = {"ncmoe": n, "llama_bench": theirs, "moedesk": mine, "expert_counts": count_every is not None,
                         "count_every": count_every, "decode_ratio": round(mine["tg"] / theirs["tg"], 3),
                         "prefill_ratio": round(mine["pp"] / theirs["pp"], 3)}
        counting = f"on (1 decode step in {count_every})" if count_every is not None else "off"
        print(f"{label}, -ncmoe {n}, expert counts {counting}: decode {mine['tg']:.1f} vs llama-bench "
              f"{theirs['tg']:.1f} tok/s = {report[label]['decode_ratio']:.3f}x; prefill {args.prompt} "
              f"{mine['pp']:.1f} vs {theirs['pp']:.1f} = {report[label]['prefill_ratio']:.3f}x (target >= 0.95x; "
              f"its runs, the first cold: {mine['pp_runs']}); "
              f"the engine's decode runs {mine['tg_runs']}; a bare llama_decode loop on its context "
              f"{mine['tg_bare']} tok/s; a bare prefill {mine['pp_bare']}")
    # llama-bench again: the ratios above are against its first run; a second that moved as much as the gap
    # being looked for says the box drifted, not the engine.
    after = llama_bench(args.llama_bench, gguf, n, args.threads, args.prompt, args.tokens, args.reps)
    report["llama_bench_after"] = after
    print(f"llama-bench decode before the engine's lines {before['tg']:.1f}, after {after['tg']:.1f} tok/s "
          f"({after['tg'] / before['tg']:.3f}x); prefill {before['pp']:.1f}, {after['pp']:.1f}")
    # llama-bench maps the file by default, where the engine reads it once experts stay in RAM beside a GPU
    # (engine.llamacpp.placement.Placement.page_locked): the same reading llama-bench does with -lm none.
    try:
        read = llama_bench(args.llama_bench, gguf, n, args.threads, args.prompt, args.tokens, args.reps, ("-lm", "none"))
    except subprocess.CalledProcessError:  # a llama-bench before load modes
        read = None
    report["llama_bench_read"] = read
    if read:
        mine = report["wrapper"]["moedesk"]
        print(f"llama-bench -lm none (the file read): decode {read['tg']:.1f}, prefill {read['pp']:.1f} tok/s; the "
              f"engine's counted line over it: decode {mine['tg'] / read['tg']:.3f}x, prefill "
              f"{mine['pp'] / read['pp']:.3f}x")
    if args.batched_bench:
        prompt_tokens, gen_tokens = 128, 64  # bench_serve.py's defaults, for its four clients beside one
        rates = batched_bench(args.batched_bench, gguf, args.threads, prompt_tokens, gen_tokens)
        report["batched_bench"] = {str(n): rate for n, rate in rates.items()}
        print(batched_line(rates, prompt_tokens, gen_tokens))


def placement_lines(args, gguf: str, shape, report: dict) -> None:
    """For each budget, llama-bench at every fitting -ncmoe (the sweep) against the engine's own choice."""
    report["placement"] = []
    budgets = [float(b) for b in args.budgets.split(",")]
    # One definition of a budget for the sweep and the engine: GPU bytes for everything llama.cpp puts there.
    need = needs(gguf, shape, int(max(budgets) * 1e9), context_for(args.prompt, args.tokens), args.threads,
                 [int(b * 1e9) for b in budgets], args.sweep_span)
    report["need_by_ncmoe"] = need
    for budget_gb in budgets:
        budget = int(budget_gb * 1e9)
        fitting = sorted(m for m in need if need[m]["llama_cpp"]["total"] <= budget)
        if args.sweep_span is not None:
            fitting = fitting[:args.sweep_span + 1]
        if not fitting:
            print(f"budget {budget_gb:g} GB: llama.cpp needs more than that at every -ncmoe")
            continue
        sweep = {m: llama_bench(args.llama_bench, gguf, m, args.threads, args.prompt, args.tokens)["tg"]
                 for m in fitting}
        best = max(sweep, key=sweep.get)
        # The median of --reps decodes, as the wrapper's lines; and again with the counts off: a counted step cuts
        # the graph of every MoE layer whose experts are on the GPU (engine/llamacpp/expert_counts.py), which the
        # wrapper's line (every expert in RAM) does not show.
        auto = ours(gguf, None, budget / GIB, args.prompt, args.tokens, args.threads, decodes=args.reps)
        uncounted = ours(gguf, None, budget / GIB, args.prompt, args.tokens, args.threads, count_experts=False,
                         decodes=args.reps)
        ratio = auto["tg"] / sweep[best]
        report["placement"].append({"budget_gb": budget_gb, "sweep_tg": sweep, "best_ncmoe": best,
                                    "auto_ncmoe": auto["ncmoe"], "auto_tg": auto["tg"], "ratio": round(ratio, 3),
                                    "auto_tg_runs": auto["tg_runs"], "uncounted_tg": uncounted["tg"],
                                    "uncounted_ratio": round(uncounted["tg"] / sweep[best], 3),
                                    "auto_gpu_bytes": auto["gpu_bytes"], "auto_fits": auto["gpu_bytes"] <= budget})
        print(f"budget {budget_gb:g} GB: llama-bench decode by -ncmoe {sweep}; best -ncmoe {best} "
              f"{sweep[best]:.1f} tok/s; moedesk chose {auto['ncmoe']} ({auto['why']}; llama.cpp took "
              f"{auto['gpu_bytes'] / 1e9:.2f} GB of the GPU{'' if auto['gpu_bytes'] <= budget else ': OVER'}): "
              f"{auto['tg']:.1f} tok/s = {ratio:.3f}x (target >= 0.95x; runs {auto['tg_runs']}); expert counts off "
              f"{uncounted['tg']:.1f} = {uncounted['tg'] / sweep[best]:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
