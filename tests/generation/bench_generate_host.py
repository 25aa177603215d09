"""Where a large batch's generation step goes: `python tests/generation/bench_generate_host.py [options]`.

Runs Engine.generate over the shipped draft prompts as `moedesk train-draft` does (greedy and sampled answers,
top-p 0.95) and splits the scheduler's loop time into the decode forward (graphed or eager), the prefill
forwards, sampling (sample_tokens) and the rest: the host's per-step, per-row work (scheduler bookkeeping,
detokenisation, stop checks, tensor building). --fake-forward replaces the model by a ready logits table, so
only the host's work (and sampling) is timed. On a GPU each timed part ends with a synchronize, so the parts
add up (and the total is a little slower than an untimed run). Prints one JSON line.

Not a test (pytest does not collect it): a measurement to run by hand, e.g. on the GPU box
`python tests/generation/bench_generate_host.py --model demo --dtype float32 --device cuda --batch 256
--requests 1024 --max-new-tokens 256`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moedesk.engine.generation import decoder as D  # noqa: E402
from moedesk.engine.generation.decoder import synchronize  # noqa: E402
from moedesk.engine.requests import Request, SamplingParams  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402
from moedesk.training import train as T  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--vary", action="store_true",
                    help="each request's max_new_tokens drawn from [N/4, N] (seeded): rows finish at different steps, "
                         "as answers that end at an EOS do")
    ap.add_argument("--samples", type=int, default=2, help="every k-th request greedy, the others sampled")
    ap.add_argument("--refill", type=int, default=1)
    ap.add_argument("--fake-forward", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    device = engine.device
    if args.fake_forward:
        table = torch.randn(args.batch, engine.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
        for e in set(engine.tokenizer.eos_token_ids) | set(engine.config.eos_token_ids):
            table[:, e] = -1e9  # no answer ends early
        table = table.to(device)
        engine.model.forward = lambda tokens, *a, **k: table[:tokens.shape[0], None, :]
        engine.runner.graphs = None
    prompts = T.load_prompts(T.default_prompts_path())
    requests = []
    for i in range(args.requests):
        k = i % args.samples
        new = random.Random(i).randint(max(1, args.max_new_tokens // 4), args.max_new_tokens) if args.vary \
            else args.max_new_tokens
        params = SamplingParams(max_new_tokens=new, temperature=0 if k == 0 else 0.8, top_p=1.0 if k == 0 else 0.95,
                                seed=k, ignore_eos=True)
        requests.append(Request(T.prompt_ids(engine.tokenizer, prompts[i % len(prompts)]), params, tag=i))

    parts = {"decode_fwd": 0.0, "prefill_fwd": 0.0, "prefill_n": 0, "sample": 0.0, "loop": 0.0, "loops": 0}
    state = threading.local()  # in a decode step: the model's forward there is the decode's, not a prefill

    def timed(name, fn, count=None):
        def run(*a, **k):
            if name == "prefill_fwd" and getattr(state, "decoding", False):
                return fn(*a, **k)
            synchronize(device)
            t = time.perf_counter()
            state.decoding = getattr(state, "decoding", False) or name == "decode_fwd"
            try:
                out = fn(*a, **k)
                synchronize(device)
            finally:
                if name == "decode_fwd":
                    state.decoding = False
            parts[name] += time.perf_counter() - t
            if count:
                parts[count] += 1
            return out
        return run

    step = D.Decoder._step
    D.Decoder._step = lambda self, *a: timed("decode_fwd", lambda: step(self, *a))()
    engine.model.forward = timed("prefill_fwd", engine.model.forward, "prefill_n")
    D.sample_tokens = timed("sample", D.sample_tokens)
    engine.scheduler._step = timed("loop", engine.scheduler._step, "loops")
    try:
        list(engine.generate(requests[:4], batch_size=4))  # warm-up (and graph capture at batch 4)
        for k in parts:
            parts[k] = 0
        before = dict(engine.scheduler.counters)
        started = time.perf_counter()
        extra = {"refill": args.refill} if args.refill != 1 else {}  # (runs on a tree from before refill, too)
        out = list(engine.generate(requests, batch_size=args.batch, **extra))
        wall = time.perf_counter() - started
    finally:
        D.Decoder._step = step
    c = {k: engine.scheduler.counters[k] - before[k] for k in before}
    steps, rows = c["decode_steps"], c["batch_sum"]
    host = parts["loop"] - parts["decode_fwd"] - parts["prefill_fwd"] - parts["sample"]
    print(json.dumps(dict(
        model=args.model, device=str(device), batch=args.batch, requests=args.requests,
        max_new_tokens=args.max_new_tokens, vary=args.vary, refill=args.refill, fake_forward=args.fake_forward,
        wall_s=round(wall, 3), tokens=sum(len(o.token_ids) for o in out),
        tok_s=round(sum(len(o.token_ids) for o in out) / wall, 1), decode_steps=steps, loops=parts["loops"],
        mean_batch=round(rows / max(steps, 1), 1), prefill_forwards=parts["prefill_n"],
        ms_per_loop=round(1000 * parts["loop"] / max(parts["loops"], 1), 3),
        decode_fwd_ms_per_step=round(1000 * parts["decode_fwd"] / max(steps, 1), 3),
        prefill_fwd_ms_per_loop=round(1000 * parts["prefill_fwd"] / max(parts["loops"], 1), 3),
        sample_ms_per_loop=round(1000 * parts["sample"] / max(parts["loops"], 1), 3),
        host_ms_per_loop=round(1000 * host / max(parts["loops"], 1), 3),
        host_ms_per_row_step=round(1000 * host / max(rows, 1), 4))))


if __name__ == "__main__":
    main()
