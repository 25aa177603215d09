"""Acceptance length of a draft head (accepted drafts + the target's own token per verify step), greedy chain and
beam tree at the same number of verified tokens, on MT-bench first turns (evaluation only: the file is read
where it lies at run time, never copied into the repository or trained on).

    python3 tests/perf/draft_acceptance.py                                   # the demo and its shipped head
    python3 tests/perf/draft_acceptance.py --model M --draft DIR --questions FILE.jsonl --max-new-tokens 256

Prints one JSON object: per mode, the mean acceptance length and its counts (engine.speculative.acceptance).
--prompts takes a JSONL of {"messages": [...]} or {"prompt": ...} lines instead (e.g. assets/draft_prompts.jsonl).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moedesk.engine.runtime import Engine  # noqa: E402
from moedesk.engine.speculative.acceptance import acceptance_length  # noqa: E402

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench_questions.jsonl"


def first_turns(path: Path) -> list[str]:
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default=None, help="EAGLE head folder (default: the demo's shipped head)")
    ap.add_argument("--questions", default=str(MT_BENCH), help="MT-bench question.jsonl (first turns are used)")
    ap.add_argument("--prompts", default=None, help="a JSONL of messages/prompt lines instead of --questions")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--gamma", type=int, default=4, help="draft length: chain length, tree depth (default 4)")
    ap.add_argument("--width", type=int, default=4, help="beam mode: children per node (default 4)")
    ap.add_argument("--modes", default="greedy,beam")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts:
        from moedesk.training.train import load_prompts

        prompts, source = load_prompts(args.prompts), args.prompts
    else:
        prompts, source = first_turns(Path(args.questions)), args.questions
    prompts = prompts[:args.limit]
    engine = Engine.load(args.model, device=args.device)
    report = {"model": args.model, "draft": args.draft or "shipped demo head", "prompts": source, "n": len(prompts),
              "gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "device": str(engine.device)}
    for mode in args.modes.split(","):
        # beam: a tree of as many nodes as the chain has drafts, so both verify gamma + 1 tokens per step
        started = time.perf_counter()
        r = acceptance_length(engine, prompts, args.draft, mode, args.gamma, args.width if mode == "beam" else 1,
                              budget=args.gamma, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        r.pop("per_prompt")
        report[mode] = {**r, "mean": round(r["mean"], 3), "seconds": round(time.perf_counter() - started, 1)}
        print(f"{mode}: {report[mode]['mean']} tokens per verify step", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
