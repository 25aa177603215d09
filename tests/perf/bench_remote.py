"""What --engine remote costs over talking to the server directly: the same greedy requests, N at once, through
RemoteEngine.generate and through plain streamed POSTs, against one `moedesk serve` started here.

    python tests/perf/bench_remote.py --model M [--device cuda] [--streams 1,4,16] [--tokens 128]

Prints tok/s of each path per concurrency and their ratio (remote engine / direct); the texts must agree.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.app.serve_process import serve_process

KEY = "bench-remote"


def direct(base: str, model: str, prompts: list[list[int]], tokens: int) -> tuple[list[str], float]:
    def one(ids):
        body = {"model": model, "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text = ""
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    text += choices[0].get("text") or ""
        return text

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(one, prompts))
    return texts, time.perf_counter() - started


def through_engine(engine, prompts: list[list[int]], tokens: int) -> tuple[list[str], float]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    done = sorted(engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)],
                                  batch_size=len(prompts)), key=lambda c: c.tag)
    return [c.text for c in done], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    with serve_process(["--model", args.model, "--device", args.device, "--batch-size", str(max(counts))], KEY,
                       startup_s=1800) as base:
        engine = Engine.load(args.model, engine="remote", url=base, api_key=KEY)
        questions = [f"Write a long story about the number {i}." for i in range(max(counts))]
        prompts = [engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": q}]),
                                           add_special_tokens=False) for q in questions]
        through_engine(engine, prompts[:1], 8)  # warm-up: the server's first step captures its graphs
        for n in counts:
            plain, plain_s = direct(base, engine.served_model, prompts[:n], args.tokens)
            ours, ours_s = through_engine(engine, prompts[:n], args.tokens)
            rate = n * args.tokens
            print(f"streams {n:>3}: direct {rate / plain_s:8.1f} tok/s, --engine remote {rate / ours_s:8.1f} tok/s, "
                  f"ratio {plain_s / ours_s:.3f}, texts equal: {plain == ours}")
        engine.close()


if __name__ == "__main__":
    main()
