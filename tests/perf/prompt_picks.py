"""How many experts one random prompt picks in a GGUF, counted through moedesk's llama.cpp engine: what llama.cpp's
prefill copies to the GPU when the experts sit in RAM (it copies only the experts a micro-batch uses), so what its
prefill figure in a comparison rests on. The tokens are drawn over the whole vocabulary, as llama-bench draws them.
Runs on the CPU (every expert in RAM): routing does not depend on where the experts are.
Usage: python3 tests/perf/prompt_picks.py FILE.gguf [--tokens 512] [--seed 0] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moedesk.engine.requests import Request, SamplingParams  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402

FIRST_ID = 3  # past the placeholder vocabulary's <unk>, <s> and </s> (bench/synthetic_gguf.py)


def prompt_picks(path: str, tokens: int = 512, seed: int = 0) -> list[np.ndarray]:
    """Per MoE layer, how often each expert was picked by one random prompt of `tokens` tokens. llama.cpp runs the
    last layer of most architectures for the tokens whose logits it returns only: that row counts one token."""
    engine = Engine.load(path, engine="llama.cpp", device="cpu", context_length=tokens + 8, count_experts=True)
    try:
        ids = np.random.default_rng(seed).integers(FIRST_ID, engine.vocab_size, size=tokens).tolist()
        engine.complete([Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=1))])
        return [np.array(row) for row in engine.expert_map()[1]]
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    picks = prompt_picks(args.gguf, args.tokens, args.seed)
    used = [int((row > 0).sum()) for row in picks]
    report = {"gguf": args.gguf, "tokens": args.tokens, "used": used, "experts": [len(row) for row in picks],
              "top8_share": [round(float(np.sort(row)[-8:].sum() / max(row.sum(), 1)), 3) for row in picks]}
    print(f"a {args.tokens}-token prompt picked {sum(used)} of {sum(report['experts'])} experts; by layer {used}")
    if args.json:
        Path(args.json).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
