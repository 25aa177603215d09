#!/usr/bin/env bash
# On the GPU box, from the repo root, in one device command (~9 min): gpt-oss-120b's first 8 layers (MXFP4 experts in
# RAM) decoded by this tree and an older one side by side (ab_bench.sh: a warm-up thrown away, then two rounds of
# old, new and new with MOEDESK_Q8_MXFP4=0, the float path), then mxfp4's integer route against the float path in
# the experts kernel alone and in an all-resident decode step's profile.
#   BASE=.baseline bash tests/perf/gpt_oss_ab.sh
# BASE: the older tree (`git archive REV | tar -x -C .baseline`, carried). Leaves in $OUT: gpt_oss_ab.txt (the
# tables) and gpt_oss_ab.tar.gz (all).
set -uo pipefail
. tests/perf/gpu_env.sh
BASE=${BASE:?set BASE to the older tree}
W=/tmp/gpt_oss_ab; mkdir -p "$W"
OUT=$W WARMUP=1 ROUNDS=2 ALSO=MOEDESK_Q8_MXFP4=0 timeout 480 bash tests/perf/ab_bench.sh \
  "--shape gpt-oss-120b --layers 8 --expert-format mxfp4 --gpu-budget 0 --prefill 512" > "$W/ab.txt"
for route in 0 1; do
  MOEDESK_Q8_MXFP4=$route timeout 120 python3 tests/perf/bench_gpu_quant.py --no-sweep --formats mxfp4 \
    --shapes gpt-oss > "$W/kernel_q8_$route.txt" 2>&1 || echo "bench_gpu_quant (route $route) failed"
  MOEDESK_Q8_MXFP4=$route timeout 150 python3 tests/perf/profile_gpu_decode.py gpt-oss-120b:8 --expert-format mxfp4 \
    > "$W/profile_q8_$route.txt" 2>&1 || echo "profile_gpu_decode (route $route) failed"
done
{
  cat "$W/ab.txt"
  for route in 0 1; do
    echo "MOEDESK_Q8_MXFP4=$route, the experts kernel:"; grep -iE "mxfp4" "$W/kernel_q8_$route.txt" | head -8
    echo "MOEDESK_Q8_MXFP4=$route, all-resident decode step:"; grep -E "tok/s|packed experts|dense GEMM" \
      "$W/profile_q8_$route.txt"
  done
} | tee "$OUT/gpt_oss_ab.txt"
tar czf "$OUT/gpt_oss_ab.tar.gz" -C "$W" .
