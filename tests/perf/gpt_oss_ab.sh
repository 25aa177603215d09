#!/usr/bin/env bash
# On the GPU box, from the repo root, in one device command (~9 min): gpt-oss-120b's first 8 layers (MXFP4 experts in
# RAM) decoded by this tree and an older one side by side, then mxfp4's integer route (MOEDESK_Q8_MXFP4=1) against
# the float path: the same bench, the experts kernel alone, and an all-resident decode step's profile.
#   BASE=.baseline bash tests/perf/gpt_oss_ab.sh
# BASE: the older tree (`git archive REV | tar -x -C .baseline`, carried). The first run on a fresh machine paid 1.7x
# the host costs of the later ones (docs/measurements.md, "Session 49"), so one run is thrown away first; then two
# rounds of old, new, new with the route. Leaves in $OUT: gpt_oss_ab.txt (the tables) and gpt_oss_ab.tar.gz (all).
set -uo pipefail
. tests/perf/gpu_env.sh
BASE=${BASE:?set BASE to the older tree}
W=/tmp/gpt_oss_ab; mkdir -p "$W"
CASE="--shape gpt-oss-120b --layers 8 --expert-format mxfp4 --gpu-budget 0 --prefill 512"
bench() {  # name dir [env ...]
  local name=$1 dir=$2; shift 2
  (cd "$dir" && env "$@" PYTHONPATH=/tmp/site:. timeout 120 python3 -m moedesk bench $CASE --json) \
    > "$W/$name.json" 2>> "$W/bench.log" || echo "$name failed"
}
bench warmup .
for round in 1 2; do
  bench "${round}_old" "$BASE"
  bench "${round}_new" .
  bench "${round}_new_q8" . MOEDESK_Q8_MXFP4=1
done
for route in 0 1; do
  MOEDESK_Q8_MXFP4=$route timeout 120 python3 tests/perf/bench_gpu_quant.py --no-sweep --formats mxfp4 \
    --shapes gpt-oss > "$W/kernel_q8_$route.txt" 2>&1 || echo "bench_gpu_quant (route $route) failed"
  MOEDESK_Q8_MXFP4=$route timeout 150 python3 tests/perf/profile_gpu_decode.py gpt-oss-120b:8 --expert-format mxfp4 \
    > "$W/profile_q8_$route.txt" 2>&1 || echo "profile_gpu_decode (route $route) failed"
done

{
  python3 - "$W" <<'PY'
import glob, json, os, sys
w = sys.argv[1]
print(f"{'run':<12}{'lone token':<16}{'decode':>8}{'% bound':>9}{'prefill':>9}{'16 seq':>8}{'host launch ms':>16}")
for path in sorted(glob.glob(f"{w}/*.json")):
    try:
        d = json.load(open(path))
    except ValueError:
        continue
    rows = {r["mode"]: r for r in d["results"]}
    split = d["lone_token_split"]
    lone = f"width {split['gpu_width']}" if split["gpu_width"] else f"{split['gpu_experts']} whole"
    dec = rows.get("decode", {})
    print(f"{os.path.basename(path)[:-5]:<12}{lone:<16}{dec.get('tok_s', 0):8.1f}{dec.get('pct_of_bound') or 0:9.0f}"
          f"{rows.get('prefill', {}).get('tok_s', 0):9.0f}{rows.get('batched_decode', {}).get('tok_s', 0):8.1f}"
          f"{d['profile'].get('resident_launch_ms', 0):16.2f}")
PY
  for route in 0 1; do
    echo "MOEDESK_Q8_MXFP4=$route, the experts kernel:"; grep -iE "mxfp4" "$W/kernel_q8_$route.txt" | head -8
    echo "MOEDESK_Q8_MXFP4=$route, all-resident decode step:"; grep -E "tok/s|packed experts|dense GEMM" \
      "$W/profile_q8_$route.txt"
  done
} | tee "$OUT/gpt_oss_ab.txt"
tar czf "$OUT/gpt_oss_ab.tar.gz" -C "$W" .
