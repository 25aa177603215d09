"""The table tests/perf/issue42_targets.sh ends with: each of issue 42's targets its phases measured, from the files
they left, finished or cut short (a phase cut at the deadline leaves what it wrote; what it did not is said).

Usage: python3 tests/perf/issue42_summary.py RESULTS_DIR
"""
from __future__ import annotations

import json
import os
import sys

DEPTHS = (512, 8192, 16384, 32768)


def load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def depth_lines(depth: dict, llama: list | None) -> tuple[list[str], list[tuple]]:
    ours = {(x["mode"], x["depth"]): x["tok_s"] for x in depth["results"]}
    theirs = {("prefill" if x["n_prompt"] else "decode", x["n_depth"]): x["avg_ts"] for x in llama or []}
    split = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in (depth.get("budget_split_bytes") or {}).items())
    lines = [f"32k context: {depth.get('experts_on_gpu')} experts resident; the budget in GiB: {split}",
             f"{'depth':>6}{'decode':>9}{'llama':>8}{'prefill 512':>13}{'llama':>8}"]
    for d in DEPTHS:
        lines.append(f"{d:>6}{ours.get(('decode', d), 0):>9.1f}{theirs.get(('decode', d), 0):>8.1f}"
                     f"{ours.get(('prefill', d), 0):>13.1f}{theirs.get(('prefill', d), 0):>8.1f}")
    d32, d512, l32 = ours.get(("decode", 32768)), ours.get(("decode", 512)), theirs.get(("decode", 32768))
    return lines, [("decode at 32k / decode at 512", d32 / d512 if d32 and d512 else None, 0.8),
                   ("decode at 32k / llama.cpp at 32k", d32 / l32 if d32 and l32 else None, 1.5)]


def cache_lines(cache: dict) -> tuple[list[str], list[tuple]]:
    """Both targets must hold for one setting of the cache: each interval measured is judged on both traces by its
    median paired ratio, the range of its rounds beside it; one trace missing (the run cut) is said, not skipped.
    The control (the fixed placement against itself) is shown, not judged: its range is the noise's."""
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_expert_cache import format_rows

    pairs = cache.get("pairs", [])
    lines = [f"expert cache: {cache.get('experts_on_gpu')} experts resident of the whole model, "
             f"{cache.get('experts')}; {cache.get('rounds')} paired rounds of each placement"]
    if not cache.get("complete", True):
        lines.append(f"cut at the time limit after {len(pairs)} pairs; not run: {', '.join(cache.get('skipped', []))}")
    lines.append(format_rows(pairs))
    targets = []
    measured = {(x["trace"], x["placement"]): x for x in pairs}
    # The cache as the engine runs it, from the fixed placement; one started per expert is there to compare.
    settings = dict.fromkeys(x["placement"] for x in pairs
                             if x["placement"].startswith("cache") and not x["placement"].endswith("per expert"))
    for placement in settings:
        for trace, goal in (("conversation", 1.25), ("no locality", 0.98)):
            x = measured.get((trace, placement))
            targets.append((f"{placement} / fixed, {trace} trace", x["vs_fixed"] if x else None, goal,
                            x["vs_fixed_range"] if x else None))
    if not settings:
        targets.append(("cache / fixed placement", None, 1.25))
    return lines, targets


def verdict(value: float, goal: float, spread: list[float] | None) -> str:
    """Met or not by the median; said to be within the rounds' spread where their range holds the goal."""
    met = "yes" if value >= goal else "NO"
    if spread is None:
        return met
    low, high = spread
    return f"{met} (rounds {low:.2f}-{high:.2f}x{', the goal within them' if low <= goal <= high else ''})"


def summary(results: str) -> str:
    lines = []
    for name in ("commit.txt", "gpu.txt"):
        path = os.path.join(results, name)
        lines.append(open(path).read().strip() if os.path.exists(path) else "")
    targets = []
    depth = load(os.path.join(results, "ours_depth.json"))
    if depth:
        more, found = depth_lines(depth, load(os.path.join(results, "llama_depth.json")))
        lines += more
        targets += found
    cache = load(os.path.join(results, "expert_cache.json"))
    if cache:
        more, found = cache_lines(cache)
        lines += [""] + more
        targets += found
    lines.append(f"\n{'target':<52}{'measured':>9}{'goal':>7}  met")
    for name, value, goal, *spread in targets:
        if value is None:
            lines.append(f"{name:<52}{'-':>9}{goal:>6.2f}x  not measured")
        else:
            lines.append(f"{name:<52}{value:>8.2f}x{goal:>6.2f}x  {verdict(value, goal, (spread or [None])[0])}")
    if not targets:
        lines.append("nothing measured: see issue42_targets.log and the logs in the archive")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
