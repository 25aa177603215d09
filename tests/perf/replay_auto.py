"""Replay `auto` on the round times of a `moedesk bench --speculative --json` report (spec_bench.sh writes them under
$OUT): what auto, as the code now decides, would have made of the costs that run measured, beside what it made.

    python3 tests/perf/replay_auto.py qwen3.json [--tokens 32,96]

Per batch and acceptance: a round's time per draft length from the run's own rounds (`round_log`: verify + accept
of the rounds that ran every row and captured nothing, greedy and auto runs together), plain decoding's step from
its tok/s, the lengths no round ran between those in the table's proportions (tests/speculative/test_auto_replay.py's
replay). Prints the measured auto and chain speedups, then the replay's best fixed choice and auto's, 40 runs each.
Runs with no `round_log` (reports before it was written) can only be replayed by hand (that test's ROUNDS).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.speculative.test_auto_replay import SEEDS, fixed_choices, mean, simulate  # noqa: E402


def round_costs(report: dict) -> tuple[dict, dict]:
    """(T(B, k) table, {(B, α): {k: ms}}) from a report: each run's full rounds that captured nothing, averaged."""
    s = report["speculative"]
    table = {tuple(int(x) for x in key.split(",")): ms for key, ms in s["step_times_ms"].items()}
    sums: dict = {}
    for run in s["runs"]:
        b, a = run["batch"], run["acceptance"]
        costs = sums.setdefault((b, a), {1: [1000.0 * b / run["plain_tok_s"]]})
        for gamma, rows, verify_ms, accept_ms, _, captured in run.get("round_log") or []:
            if rows == b and not captured and gamma > 0:
                costs.setdefault(gamma + 1, []).append(verify_ms + accept_ms)
    return table, {key: {k: mean(v) for k, v in ks.items()} for key, ks in sums.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--tokens", default="32,96", help="new tokens a row of the replayed runs")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        table, rounds = round_costs(report)
        tokens = [int(t) for t in args.tokens.split(",")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"cannot replay {args.report}: {e}", file=sys.stderr)
        return 1
    measured = {(r["batch"], r["acceptance"], r["mode"]): r["speedup"] for r in report["speculative"]["runs"]}
    print("B     α   measured auto  chains   rounds timed (k: ms)" + "".join(
        f"   best {n} (γ)  auto {n}  ratio" for n in tokens))
    for (b, a), ks in sorted(rounds.items()):
        if max(ks) < 2 or max(k for bb, k in table if bb == b) not in ks:
            print(f"{b:<4} {a:<4}  no full round of the longest chain timed: not replayed")
            continue
        line = (f"{b:<4} {a:<4} {measured.get((b, a, 'auto'), float('nan')):>9.2f}x {measured.get((b, a, 'greedy'), 0):>7.2f}x"
                f"   {' '.join(f'{k}:{ms:.1f}' for k, ms in sorted(ks.items()))}")
        for n in tokens:
            fixed = fixed_choices(b, a, n, table, rounds)
            best = max(range(len(fixed)), key=fixed.__getitem__)
            auto = mean(simulate(b, a, n, s, None, table, rounds)[0] for s in range(SEEDS))
            line += f"   {fixed[best]:>6.2f}x ({best})  {auto:>5.2f}x  {auto / fixed[best]:.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
