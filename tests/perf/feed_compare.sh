#!/usr/bin/env bash
# On the GPU box, from the repo root: the same `moedesk bench` fed random tokens (the default, as llama-bench) and
# its own greedy choices (--feed greedy), one machine, one command, so the two feeds compare with each other.
# Session 35 saw greedy decode "at 32k" 1.54x faster than at 512 with a bound 2.25x higher (docs/benchmarks.md,
# "What decode feeds"): fed random tokens, decode at depth should stay at or under decode at 512, and the bound
# and experts touched should barely move with depth.
# Usage: [SHAPE=S] bash tests/perf/feed_compare.sh [layers] [depths...]   (default: mixtral-8x7b, 8 layers, 512 32768)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
layers=${1:-8}; shift || true; shape=${SHAPE:-mixtral-8x7b}
depths=${*:-512 32768}
for feed in random greedy; do
  python3 -m moedesk bench --shape "$shape" --layers "$layers" --expert-format q4_k --gpu-budget 0 --prefill \
    --batch 16 --context $depths --feed "$feed" --json > "$OUT/feed_$feed.json" 2>>"$OUT/feed.log" \
    || echo "--feed $feed failed (tail of $OUT/feed.log)"
done
python3 - "$OUT" <<'PY'
import json, os, sys
print(f"{'feed':<8}{'mode':<16}{'batch':>5}{'depth':>7}{'tok/s':>9}{'bound':>11}{'%':>5}{'experts':>9}")
for feed in ("random", "greedy"):
    path = os.path.join(sys.argv[1], f"feed_{feed}.json")
    if not os.path.exists(path):
        continue
    for r in json.load(open(path))["results"]:
        if r["mode"] != "prefill":
            print(f"{feed:<8}{r['mode']:<16}{r['batch']:>5}{r['depth']:>7}{r['tok_s']:>9.1f}"
                  f"{r['bound_tok_s'] or 0:>11.1f}{r['pct_of_bound'] or 0:>5.0f}{r['experts_touched'] or 0:>9}")
PY
