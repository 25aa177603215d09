#!/usr/bin/env bash
# Before/after on one machine: the same `moedesk bench` cases in this tree and in an older one, in one command
# (machines of the GPU box differ by up to 25%, so figures from two calls do not compare).
# Usage, GPU box, repo root:  BASE=.baseline bash tests/perf/ab_bench.sh "CASE ARGS" ["CASE ARGS" ...]
#   e.g. BASE=.baseline bash tests/perf/ab_bench.sh "--shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --prefill 512"
# BASE: an older tree (here: `git archive REV | tar -x -C .baseline`, carried with the call). Wheels in .whl
# are installed when present. Each case runs new, old, new, old (ROUNDS=1: new, old); the table shows every run.
# WARMUP=1: one run of the first case thrown away first (a fresh machine's first run paid 1.7-2.1x the host costs of
# later ones: docs/measurements.md, "Session 49"). ALSO="NAME=VALUE ...": each round also runs this tree with those
# settings (the table's tree "env").
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:?set BASE to the older tree}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
SITE=/tmp/site
run() {  # dir case [NAME=VALUE ...]: the case's report as JSON on stdout
  local dir=$1 case=$2; shift 2
  (cd "$dir" && env "$@" PYTHONPATH=$SITE:. PYTHONUNBUFFERED=1 python3 -m moedesk bench $case --json) 2>>"$OUT/ab_bench.log"
}
[ -n "${WARMUP:-}" ] && { run . "$1" > /dev/null || echo "warm-up failed"; }
trees="new old"; [ -n "${ALSO:-}" ] && trees="new old env"
n=0
for case in "$@"; do
  n=$((n + 1))
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in $trees; do
      case $tree in
        new) run . "$case" ;;
        old) run "$BASE" "$case" ;;
        env) run . "$case" $ALSO ;;
      esac > "$OUT/case${n}_${tree}_${round}.json" || echo "case $n $tree failed"
    done
  done
done
python3 - "$OUT" "$@" <<'PY'
import glob, json, os, sys
out, cases = sys.argv[1], sys.argv[2:]
print(f"{'case':<5}{'tree':<5}{'run':<4}{'mode':<15}{'tokens':>7}{'batch':>6}{'tok/s':>9}{'bound':>9}{'%':>6}  lone token")
for n, case in enumerate(cases, 1):
    print(f"case {n}: {case}")
    for path in sorted(glob.glob(os.path.join(out, f"case{n}_*.json"))):
        _, tree, run = os.path.basename(path)[:-5].split("_")
        try:
            report = json.load(open(path))
        except ValueError:
            continue
        split = report.get("lone_token_split") or {}
        lone = f"width {split['gpu_width']}" if split.get("gpu_width") else f"{split.get('gpu_experts', 0)} whole"
        for r in report["results"]:
            print(f"{n:<5}{tree:<5}{run:<4}{r['mode']:<15}{r['tokens']:>7}{r['batch']:>6}{r['tok_s']:>9.1f}"
                  f"{(r['bound_tok_s'] or 0):>9.1f}{(r['pct_of_bound'] or 0):>6.0f}  {lone}")
PY
