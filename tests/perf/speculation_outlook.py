"""What the settings screen will say about speculation on this machine, and what auto's first measurement costs:
the step times T(B, k) measured afresh (the time it took, with its progress), then the batch-1 outlook.

    python3 tests/perf/speculation_outlook.py                       # the demo
    python3 tests/perf/speculation_outlook.py --model M --draft-length 4

Prints one JSON object: seconds the measurement took, T(1, k) for each k, and the outlook (best draft length, its
speedup at 90% acceptance with free drafting, the verify step's cost in plain steps, the acceptance it needs to
pay, whether speculation loses).
On the GPU box the expectation is the opposite of a CPU's: a verify step of 5 tokens near one plain step, so the
settings say speculation can pay; docs/measurements.md takes the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moedesk.engine.runtime import Engine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--draft-length", type=int, default=4)
    args = parser.parse_args()
    engine = Engine.load(args.model, device=args.device)
    progress = []
    started = time.perf_counter()
    from moedesk.engine.speculative.job import SPECULATIVE_ROWS
    from moedesk.engine.speculative.step_times import engine_step_times

    table = engine_step_times(engine, SPECULATIVE_ROWS, args.draft_length, refresh=True,
                              progress=lambda done: progress.append((round(time.perf_counter() - started, 2), done)))
    seconds = time.perf_counter() - started
    outlook = engine.speculation_outlook(args.draft_length)
    print(json.dumps({"model": engine.name, "device": str(engine.device), "measure_s": round(seconds, 2),
                      "progress": progress,
                      "T1_ms": {k: round(ms, 3) for (b, k), ms in sorted(table.items()) if b == 1},
                      "outlook": None if outlook is None else {
                          "gamma": outlook.gamma, "speedup": round(outlook.speedup, 3),
                          "verify_cost": round(outlook.verify_cost, 3), "break_even": outlook.break_even,
                          "loses": outlook.loses}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
