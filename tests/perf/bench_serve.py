"""`moedesk serve` under load: its load path at real size, and N concurrent streaming clients sharing a batch.

Usage (GPU box, repo root, after `python3 tests/perf/make_mixtral_checkpoint.py CKPT`):
    python3 tests/perf/bench_serve.py --model CKPT [--clients 16] [--prompt-tokens 128] [--max-tokens 64]
        [--gpu-budget 0] [--device auto] [--dtype bfloat16] [--port 8123] [--client-cpus 15] [--json OUT.json]
    python3 tests/perf/bench_serve.py --model CKPT --streamed-vs-plain   (also what streaming costs the steps)
    python3 tests/perf/bench_serve.py --model CKPT --compare-bench       (moedesk bench --batch N before and after)
    python3 tests/perf/bench_serve.py --smoke      (CPU, a tiny Mixtral-shaped checkpoint, a few seconds)
    python3 tests/perf/bench_serve.py --model FILE.gguf --engine llama.cpp --clients 4   (serve on llama.cpp)

Starts `moedesk serve` as its own process (every expert in RAM by default: --gpu-budget 0) and measures:

- load: the checkpoint's size, how long reading it took (the `load` phase the server logs, before profiling and
  calibration) and so GB/s (the files are read once beforehand, so this is from the page cache), the
  server's resident memory after start-up against the checkpoint size, and the peak during the load phase
  (VmRSS polled every 20 ms from /proc);
- one client alone: total tokens/s and time to first token (TTFT);
- N clients at once: total tokens/s over the whole run (prefill included), the steady-state decode rate while
  all N stream (tokens arriving between the moment every client has its first token and the moment the first
  one ends), and that over the one-client rate;
- a newcomer: TTFT of a client arriving while N-1 others stream, against its TTFT alone.

--client-cpus keeps the clients (this process) on those CPUs once the server has started (it keeps them all):
the clients otherwise take their CPU time from the cores the server's expert kernel runs on.

Prompts are random token ids (exact lengths, no tokenizer in the way), replies ignore the end token.
Compare the N-client decode rate with `moedesk bench --shape mixtral-8x7b --layers 8 --gpu-budget 0 --batch N`
(--compare-bench runs it before and after the server: on the GPU box's machines it moved by up to 60% from run
to run, with their memory bandwidth, so only a ratio against bench in the same run means anything).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # moedesk from this checkout, as the server it starts


def model_facts(model: Path) -> tuple[int, int, list[Path]]:
    """(layers, vocabulary size, weight files) of a Hugging Face folder (its config.json, its safetensors) or of a
    GGUF file (its header; of a split GGUF, every part), the two kinds of --model serve takes."""
    if model.is_file():
        from moedesk.engine.llamacpp.fit import arch_value, read_header, value

        header = read_header(model)
        return arch_value(header, "block_count"), len(value(header, "tokenizer.ggml.tokens")), list(header.paths)
    config = json.loads((model / "config.json").read_text())
    return config["num_hidden_layers"], config["vocab_size"], sorted(model.glob("*.safetensors"))


def read_once(files: list[Path]) -> tuple[int, float]:
    """Read every weight file once (into the page cache); (bytes, seconds)."""
    total, started = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total, time.perf_counter() - started


def cpu_list(text: str) -> set[int]:
    """'15' or '12-15' or '0,15' as a set of CPU numbers."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin_this_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (sched_setaffinity with pid 0 moves the calling thread only)."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cpus)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A memory line of /proc/PID/status in KiB: VmRSS, or its parts RssAnon (pinned and plain RAM the process
    allocated), RssFile (mapped file pages, e.g. safetensors memory maps still open), RssShmem."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Server:
    """`moedesk serve` in a child process; its stderr is watched for the phase lines and RSS is polled."""

    def __init__(self, args):
        self.url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "moedesk", "serve", "--model", str(args.model), "--port", str(args.port),
               "--device", args.device, "--batch-size", str(max(args.clients, 1)), "--max-queue", "256",
               "--context", str(args.context), "--model-name", "bench"]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.gpu_budget is not None:
            cmd += ["--gpu-budget", str(args.gpu_budget)]
        if args.prefill_chunk:
            cmd += ["--prefill-chunk", str(args.prefill_chunk)]
        if args.engine:
            cmd += ["--engine", args.engine]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.phases: dict[str, float] = {}
        self.log: list[str] = []
        self.peak_during_load = 0
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._poll_rss, daemon=True).start()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            match = re.match(r"moedesk: (\w+) done \(([\d.]+)s\)", line)
            if match:
                self.phases[match.group(1)] = float(match.group(2))

    def _poll_rss(self):
        while self.proc.poll() is None and "load" not in self.phases:
            try:
                self.peak_during_load = max(self.peak_during_load, rss_kib(self.proc.pid))
            except OSError:
                return
            time.sleep(0.02)

    def wait_ready(self, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("moedesk serve exited:\n" + "\n".join(self.log[-20:]))
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("moedesk serve did not come up in time:\n" + "\n".join(self.log[-20:]))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                     first: asyncio.Event | None = None) -> dict:
    """One streamed completion; the arrival time of every piece of text, and the moedesk stats. `first` is set
    when the first text arrives."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    arrivals, usage, extension = [], None, {}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                    if first is not None:
                        first.set()
                if choice.get("finish_reason"):
                    extension = chunk.get("moedesk", {})
    tokens = usage["completion_tokens"] if usage else len(arrivals)
    return {"started": started, "ended": time.perf_counter(), "arrivals": arrivals, "tokens": tokens,
            "ttft": arrivals[0] - started if arrivals else None, "stats": extension}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def run_clients(url: str, args, vocab: int) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        await stream_one(client, url, prompts(1, args.prompt_tokens, vocab, 99)[0], 4)  # warm-up (graphs, caches)
        alone_before = await server_stats(client, url)
        alone = await stream_one(client, url, prompts(1, args.prompt_tokens, vocab, 1)[0], args.max_tokens)
        alone_after = await server_stats(client, url)
        server_before = await server_stats(client, url)
        together_started = time.perf_counter()
        runs = await asyncio.gather(*[stream_one(client, url, p, args.max_tokens)
                                      for p in prompts(args.clients, args.prompt_tokens, vocab, 2)])
        together_ended = time.perf_counter()
        server_after = await server_stats(client, url)
        # A newcomer into a running batch of N-1: they get a long reply, it arrives once all of them stream.
        firsts = [asyncio.Event() for _ in range(max(args.clients - 1, 0))]
        background = [asyncio.create_task(stream_one(client, url, p, args.max_tokens * 4, first))
                      for p, first in zip(prompts(len(firsts), args.prompt_tokens, vocab, 3), firsts)]
        newcomer_prompt = prompts(1, args.prompt_tokens, vocab, 4)[0]
        await asyncio.gather(*(first.wait() for first in firsts))
        await asyncio.sleep(0.3)  # a few decode steps into the batch
        newcomer = await stream_one(client, url, newcomer_prompt, 8)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        newcomer_alone_runs = []
        await asyncio.sleep(1.0)  # the cancelled ones have left
        for _ in range(2):
            newcomer_alone_runs.append(await stream_one(client, url, newcomer_prompt, 8))
    alone_rate = alone["tokens"] / (alone["ended"] - alone["started"])
    total = sum(r["tokens"] for r in runs)
    all_first = max(r["arrivals"][0] for r in runs)
    first_end = min(r["arrivals"][-1] for r in runs)
    steady = sum(sum(all_first < t <= first_end for t in r["arrivals"]) for r in runs)
    alone_ttft = min(r["ttft"] for r in newcomer_alone_runs)
    return {
        "alone_tok_s": alone_rate, "alone_ttft_s": alone["ttft"],
        "clients": args.clients, "together_tok_s": total / (together_ended - together_started),
        "together_decode_tok_s": steady / (first_end - all_first) if first_end > all_first else None,
        "mean_batch": sum(r["stats"].get("mean_batch") or 0 for r in runs) / len(runs),
        "newcomer_ttft_s": newcomer["ttft"], "newcomer_alone_ttft_s": alone_ttft,
        # the server's own count of the N clients' decode steps: their rate without HTTP, streaming or the clients
        "server_alone_decode_tok_s": decode_rate(alone_before, alone_after),
        "server_decode_tok_s": decode_rate(server_before, server_after),
        "server_step_ms": step_ms(server_before, server_after),
        # when each of the N got its first and last token, from the moment they were sent
        "together_first_s": sorted(r["arrivals"][0] - together_started for r in runs),
        "together_last_s": sorted(r["arrivals"][-1] - together_started for r in runs),
        "server_together": {k: server_after[k] - server_before[k] for k in
                            ("decode_steps", "prefill_pieces", "prefill_tokens", "batch_sum", "decode_seconds")},
    }


def bench_batched(args, layers: int) -> float:
    """`moedesk bench`'s batched decode of --clients sequences on the Mixtral-8x7B shape with `layers` layers,
    every expert in RAM (its own random weights, the checkpoint's shape; --smoke: the tiny shape): tok/s."""
    shape = ["--shape", "tiny-moe", "--device", "cpu"] if args.smoke else \
        ["--shape", "mixtral-8x7b", "--layers", str(layers), "--gpu-budget", "0"]
    cmd = [sys.executable, "-m", "moedesk", "bench", *shape, "--batch", str(args.clients), "--decode-tokens", "32",
           "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return next(r["tok_s"] for r in json.loads(done.stdout)["results"] if r["mode"] == "batched_decode")


async def plain_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = await client.post(url + "/v1/completions", json=body)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


async def streamed_vs_plain(url: str, args, vocab: int, rounds: int = 2) -> list[dict]:
    """The server's own decode step time with the N clients streaming, then with the same N asking for plain
    replies (nothing to deliver between steps), alternating: what delivering the stream costs the steps."""
    limits = httpx.Limits(max_connections=args.clients + 4)
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        for r in range(rounds):
            for mode in ("streamed", "plain"):
                before = await server_stats(client, url)
                ps = prompts(args.clients, args.prompt_tokens, vocab, 10 + r)
                if mode == "streamed":
                    await asyncio.gather(*[stream_one(client, url, p, args.max_tokens) for p in ps])
                else:
                    await asyncio.gather(*[plain_one(client, url, p, args.max_tokens) for p in ps])
                after = await server_stats(client, url)
                steps = after["decode_steps"] - before["decode_steps"]
                cpu_ms = after["experts"].get("cpu_expert_ms", 0) - before["experts"].get("cpu_expert_ms", 0)
                rows.append({"mode": mode, "round": r, "decode_tok_s": decode_rate(before, after),
                             "step_ms": step_ms(before, after),
                             # the executor's CPU expert time (prefill pieces included) per decode step
                             "cpu_expert_ms_per_step": cpu_ms / steps if steps else None})
    return rows


async def server_stats(client: httpx.AsyncClient, url: str) -> dict:
    """The scheduler's counters, with the expert executor's (cumulative) under "experts"."""
    reply = (await client.get(url + "/moedesk/stats")).json()
    return {**reply["scheduler"], "experts": reply.get("experts") or {}}


def decode_rate(before: dict, after: dict) -> float | None:
    seconds = after["decode_seconds"] - before["decode_seconds"]
    return (after["batch_sum"] - before["batch_sum"]) / seconds if seconds > 0 else None


def step_ms(before: dict, after: dict) -> float | None:
    steps = after["decode_steps"] - before["decode_steps"]
    return 1000 * (after["decode_seconds"] - before["decode_seconds"]) / steps if steps else None


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (tests/perf/make_mixtral_checkpoint.py)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024, help="per sequence (small: the KV cache stays small)")
    parser.add_argument("--gpu-budget", type=float, default=0.0, help="GiB of experts on the GPU (default 0)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--engine", default=None, help="passed to serve: auto, native or llama.cpp (a .gguf --model)")
    parser.add_argument("--ready-timeout", type=float, default=1800)
    parser.add_argument("--prefill-chunk", type=int, default=None, help="passed to serve (default: serve's)")
    parser.add_argument("--compare-bench", action="store_true",
                        help="run `moedesk bench --batch N` on the checkpoint's shape before and after the server")
    parser.add_argument("--streamed-vs-plain", action="store_true",
                        help="also: the server's decode steps with N streaming clients against N plain ones")
    parser.add_argument("--client-cpus", type=str, default=None,
                        help="CPUs for the clients, e.g. 15 or 14-15 (default: all; the server always gets all)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny Mixtral-shaped checkpoint, 4 clients")
    args = parser.parse_args()
    scratch = None
    if args.smoke:
        sys.path.insert(0, str(REPO / "tests" / "perf"))
        from make_mixtral_checkpoint import write_checkpoint

        scratch = tempfile.TemporaryDirectory()
        args.model = Path(scratch.name) / "mixtral-tiny"
        write_checkpoint(args.model, layers=4, tiny=True, log=lambda *_: None)
        args.device, args.dtype, args.gpu_budget = "cpu", "float32", None
        args.clients, args.prompt_tokens, args.max_tokens, args.context = 4, 32, 16, 256
    if args.model is None:
        parser.error("--model is required (or --smoke)")
    layers, vocab, files = model_facts(args.model)
    shards = len(files)
    size, seconds = read_once(files)
    bench = [bench_batched(args, layers)] if args.compare_bench else []
    server = Server(args)
    try:
        ready = server.wait_ready(args.ready_timeout)
        if args.client_cpus:
            pin_this_process(cpu_list(args.client_cpus))
        rss_after = rss_kib(server.proc.pid)
        rss_parts = {part: rss_kib(server.proc.pid, part) * 1024 / 1e9 for part in ("RssAnon", "RssFile", "RssShmem")}
        results = asyncio.run(run_clients(server.url, args, vocab))
        if args.streamed_vs_plain:
            results["streamed_vs_plain"] = asyncio.run(streamed_vs_plain(server.url, args, vocab))
    finally:
        server.stop()
        if scratch is not None:
            scratch.cleanup()
    if args.compare_bench:
        bench.append(bench_batched(args, layers))
        results["bench_tok_s"] = bench
    load_s = server.phases.get("load")
    gb = size / 1e9
    report = {"client_cpus": args.client_cpus, "checkpoint_gb": gb, "first_read_gb_s": gb / seconds, "load_s": load_s,
              "load_gb_s": gb / load_s if load_s else None, "ready_s": ready, "phases_s": server.phases,
              "rss_after_gb": rss_after * 1024 / 1e9, "rss_parts_gb": rss_parts, "peak_rss_during_load_gb": server.peak_during_load * 1024 / 1e9,
              **results}
    n = results["clients"]
    rows = [
        ("checkpoint", f"{gb:.2f} GB in {shards} shards; first read "
                       f"{gb / seconds:.2f} GB/s"),
        ("load (page cache)", f"{load_s:.2f} s, {gb / load_s:.2f} GB/s (target >= 2)" if load_s else "no load line"),
        ("server ready after", f"{ready:.1f} s (phases: {', '.join(f'{k} {v:.1f}s' for k, v in server.phases.items())})"),
        ("RSS after start-up", f"{report['rss_after_gb']:.2f} GB = {report['rss_after_gb'] / gb:.2f}x the checkpoint "
                               f"(target <= 1.1); " + ", ".join(f"{k} {v:.2f}" for k, v in rss_parts.items())),
        ("peak RSS while loading", f"{report['peak_rss_during_load_gb']:.2f} GB = "
                                   f"{report['peak_rss_during_load_gb'] / gb:.2f}x"),
        ("1 client", f"{results['alone_tok_s']:.1f} tok/s, TTFT {results['alone_ttft_s'] * 1000:.0f} ms"),
        (f"{n} clients, whole run", f"{results['together_tok_s']:.1f} tok/s = "
                                    f"{results['together_tok_s'] / results['alone_tok_s']:.2f}x one client "
                                    f"(target >= 3.5 at 16); mean batch {results['mean_batch']:.1f}"),
        (f"{n} clients, all streaming", f"{results['together_decode_tok_s'] or 0:.1f} tok/s (compare: moedesk bench "
                                        f"--batch {n})"),
        ("server's own decode steps", f"1 client {results['server_alone_decode_tok_s'] or 0:.1f} tok/s, {n} clients "
                                      f"{results['server_decode_tok_s'] or 0:.1f} tok/s "
                                      f"({results['server_step_ms'] or 0:.1f} ms a step)"),
        (f"{n} clients' timeline", f"first tokens {results['together_first_s'][0]:.2f}-"
                                  f"{results['together_first_s'][-1]:.2f} s, last {results['together_last_s'][0]:.2f}-"
                                  f"{results['together_last_s'][-1]:.2f} s; server: "
                                  f"{results['server_together']['prefill_pieces']} prefill pieces, "
                                  f"{results['server_together']['decode_steps']} decode steps"),
        (f"newcomer into {n - 1}", f"TTFT {results['newcomer_ttft_s'] * 1000:.0f} ms vs "
                                   f"{results['newcomer_alone_ttft_s'] * 1000:.0f} ms alone = "
                                   f"{results['newcomer_ttft_s'] / results['newcomer_alone_ttft_s']:.2f}x "
                                   f"(target <= 2)"),
    ]
    if results.get("bench_tok_s"):
        before, after = results["bench_tok_s"]
        rows.append((f"bench --batch {n}", f"{before:.1f} before, {after:.1f} after: the {n} streaming clients got "
                                           f"{(results['together_decode_tok_s'] or 0) / ((before + after) / 2):.2f}x "
                                           f"their mean (target >= 0.9)"))
    for row in results.get("streamed_vs_plain", []):
        rows.append((f"{n} {row['mode']} (round {row['round']})", f"server's decode steps {row['decode_tok_s']:.1f} "
                                                                  f"tok/s, {row['step_ms']:.1f} ms a step; CPU experts "
                                                                  f"{row['cpu_expert_ms_per_step'] or 0:.1f} ms a step"))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
