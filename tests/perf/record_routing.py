"""Record a model's routing over a conversation as a routing trace (engine.offload.routing_trace.TraceRecorder), for
`simulate_expert_cache.py --locality --trace FILE`: how much recent-use locality real routing has, which the
synthetic traces only assume (docs/expert-cache.md).

Each prompt is decoded greedily, one sequence at a time, so every decode step is one token; CUDA graphs are off (the
recorder reads each layer's ids on the host).

    python3 tests/perf/record_routing.py MODEL --prompt "Write a Python function that..." --max-new-tokens 256 \\
        --out routing.jsonl
    python3 tests/perf/simulate_expert_cache.py --locality --shape mixtral-8x7b --trace routing.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="what `moedesk --model` takes: a folder, a GGUF file, a cached repo id")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt, decoded on its own; repeatable")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--gpu-budget", type=float, default=None, metavar="GiB")
    parser.add_argument("--out", required=True, metavar="JSONL")
    args = parser.parse_args()
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    os.environ["MOEDESK_NO_CUDA_GRAPHS"] = "1"  # before the engine decides on graphs

    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.offload.routing_trace import TraceRecorder, record_routing
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    try:
        engine = Engine.load(args.model, device=args.device, gpu_budget=args.gpu_budget)
    except MoedeskError as e:
        print(f"record_routing: {e}", file=sys.stderr)
        return 1
    model = getattr(engine, "model", None)
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
    if not blocks:
        print(f"record_routing: {args.model} has no MoE layers moedesk's own engine runs: nothing to record",
              file=sys.stderr)
        return 1
    try:
        recorder = TraceRecorder(args.out, [b.layer for b in blocks], engine.config.num_experts,
                                 engine.config.num_experts_per_tok)
    except OSError as e:
        print(f"record_routing: --out {args.out}: {e.strerror}", file=sys.stderr)
        return 1
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    record_routing(engine.model, recorder)
    try:
        for prompt in args.prompt:
            done = next(engine.generate([Request(engine.tokenizer.encode(prompt), greedy)], 1))
            print(f"{len(done.token_ids)} tokens: {engine.tokenizer.decode(done.token_ids)[:60]!r}", file=sys.stderr)
    finally:
        record_routing(engine.model, None)
        recorder.close()
    print(f"{args.out}: {recorder.steps} steps of {len(blocks)} layers, {engine.config.num_experts} experts, "
          f"top-{engine.config.num_experts_per_tok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
