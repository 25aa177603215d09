"""Probe (GPU box; python3 tests/perf/probe_generate_batch.py [--dtype float32] [--batches 64,256]): where does a
large batch of the demo model's generation spend its time?

train-draft generates its answers through Engine.generate (the path `moedesk batch` takes) and ran at ~3,800
tok/s on the GPU box at batch 256 for a 135M-parameter model, whose forward at that batch is a few ms of GPU
work. Prints tok/s per batch size (greedy and sampled, 64 new tokens, the shipped draft prompts), then the top
host and GPU operations of one profiled run, to say whether the GPU, the host's per-step work or the sampling
bounds it."""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.engine.requests import Request, SamplingParams  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402
from moedesk.training.train import load_prompts, prompt_ids  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile-batch", type=int, default=256, help="0: no profiled run")
    args = ap.parse_args()
    engine = Engine.load("demo", device="cuda", dtype=args.dtype)
    shipped = Path(__file__).resolve().parents[2] / "assets" / "draft_prompts.jsonl"
    prompts = [prompt_ids(engine.tokenizer, p) for p in load_prompts(shipped)]

    def run(batch, temperature, n=None):
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, top_p=0.95, seed=0)
        reqs = [Request(prompts[i % len(prompts)], params, tag=i) for i in range(n or 2 * batch)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        done = list(engine.generate(reqs, batch_size=batch))
        torch.cuda.synchronize()
        return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t)

    run(8, 0, 8)  # warm-up: kernels, graphs
    print(f"demo, {args.dtype}, {args.new_tokens} new tokens, {len(prompts)} prompts")
    for b in [int(x) for x in args.batches.split(",")]:
        run(b, 0, b)
        print(f"batch {b:>4}: greedy {run(b, 0):8.0f} tok/s, sampled {run(b, 0.8):8.0f} tok/s")
    b = args.profile_batch
    if not b:
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run(b, 0.8, b)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
    print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
