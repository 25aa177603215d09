#!/usr/bin/env bash
# On the GPU box, from the repo root, in one device command (about 4 min): the GPU kernels' integer route for every
# format it reads (docs/measurements.md, "Session 41 on the two-H200 box"). Run it after
# `tests/perf/llamacpp_engine_gpu.sh build`, which runs `pytest -m gpu` beside the build.
#   1. bench_gpu_quant.py on the Mixtral shape for every format the route reads, with the tile sweep
#   2. profile_gpu_decode.py mixtral-8x7b:8 at batch 1 and 4, the non-expert weights packed (the default on a GPU;
#      with the last step's kernel timeline) and in 16 bits (MOEDESK_PACKED_WEIGHTS=0), and batch 1 with
#      MOEDESK_Q8_ACTIVATIONS=0 (the float32 path)
# Carry .whl and .pylib. Leaves in $OUT: route_summary.txt (each step's exit and seconds, the profiles' heads, the
# bench table) and route.tar.gz (every log).
set -uo pipefail
. tests/perf/gpu_env.sh
R=/tmp/route; mkdir -p "$R"
step() {  # step NAME SECONDS COMMAND...: one step's output in $R/NAME.txt, its exit and time in steps.txt
  local name=$1 limit=$2 start; shift 2; start=$(date +%s)
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1
  echo "$name: exit $?, $(( $(date +%s) - start )) s" >> "$R/steps.txt"
}
step quant 260 python3 tests/perf/bench_gpu_quant.py --formats q4_k,q5_k,q6_k,q4_0,q8_0 --shapes mixtral
for batch in 1 4; do
  step "profile_b$batch" 60 python3 tests/perf/profile_gpu_decode.py mixtral-8x7b:8 --batch "$batch" \
    --timeline "$R/timeline_b$batch.tsv"
  MOEDESK_PACKED_WEIGHTS=0 step "profile_16bit_b$batch" 60 python3 tests/perf/profile_gpu_decode.py mixtral-8x7b:8 \
    --batch "$batch"
done
MOEDESK_Q8_ACTIVATIONS=0 step profile_float_b1 60 python3 tests/perf/profile_gpu_decode.py mixtral-8x7b:8
{
  cat "$R/steps.txt"
  for f in profile_b1 profile_16bit_b1 profile_float_b1 profile_b4 profile_16bit_b4; do
    echo "== $f"; sed -n '/tok\/s/,$p' "$R/$f.txt" | head -n 18
  done
  grep -E "^(shape|mixtral)" "$R/quant.txt"
} > "$OUT/route_summary.txt"
rm -f "$R"/*.trace.json*  # the profiles' Chrome traces: large, and the timelines hold what is read of them
tar czf "$OUT/route.tar.gz" -C /tmp route
cat "$OUT/route_summary.txt"
