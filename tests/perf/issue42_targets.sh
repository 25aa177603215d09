#!/usr/bin/env bash
# On the GPU box, from the repo root, in one device command: issue 42's expert-cache and 32k-context targets on the
# whole Mixtral-8x7B shape with Q4_K experts at a 16 GiB budget (the whole GPU's: bench/budget.py), chaining the
# existing scripts within a deadline (BUDGET_S, 540 s by default: a phase that would not finish is skipped, and
# says so).
#   1. 32k context: compare_llamacpp.sh depth-moedesk (decode and a 512-token prefill piece at 512, 8k, 16k and 32k
#      of context; 111 s in session 33); before it depth-llama where earlier commands left llama-bench built with
#      flash attention in $LLB (tests/perf/llamacpp_engine_gpu.sh build, or compare_llamacpp.sh depth-build) and the
#      whole-model GGUF (SRC=.llamacpp bash tests/perf/compare_llamacpp.sh depth-build, a device command of its own).
#      Targets: decode at 32k >= 0.8x decode at 512, >= 1.5x llama.cpp at 32k.
#   2. expert cache: bench_expert_cache.py on replayed traces, the cache against fixed placement in paired rounds,
#      the profile the depth phase stored reused; its own time limit ends it with the pairs it finished, the targets'
#      two first (docs/benchmarks.md predicts ~100 s with start-up and build for those, ~130 s with the control).
#      Targets: >= 1.25x fixed on the conversation trace, >= 0.98x fixed on the trace without locality.
# Leaves three files in $OUT: issue42_summary.txt (the table, from what finished: tests/perf/issue42_summary.py),
# issue42_targets.tar.gz (every log and JSON), issue42_targets.log (what ran, when).
# Usage: [SRC=.llamacpp] [LLB=/tmp/llb] [BUDGET_S=540] [ROUNDS=5] bash tests/perf/issue42_targets.sh
set -uo pipefail
DEST=${OUT:-/tmp/out}; SRC=${SRC:-.llamacpp}; LLB=${LLB:-/tmp/llb}; BUDGET_S=${BUDGET_S:-540}; ROUNDS=${ROUNDS:-5}
DEADLINE=$((SECONDS + BUDGET_S))
# The wheels in .whl (platformdirs and the rest the box lacks) under /tmp/site, ahead of the checkout on PYTHONPATH,
# for every phase: the expert cache's bench is run here, not by compare_llamacpp.sh, which installs them for its own.
. tests/perf/gpu_env.sh
W=/tmp/compare; R=/tmp/issue42; mkdir -p "$DEST" "$W" "$R"
export OUT=$R  # compare_llamacpp.sh copies its results to $OUT
LOG=$DEST/issue42_targets.log

# phase NAME SECONDS_NEEDED CMD...: run CMD into $R/NAME.log if its usual time still fits before the deadline,
# cut at the deadline if it runs over.
phase() {
  local name=$1 need=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < need)); then
    echo "$name: skipped ($need s needed, $left s left)" | tee -a "$LOG"; return 1
  fi
  local start=$SECONDS
  timeout "$left" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s$( ((rc == 124)) && echo ' (cut at the deadline)')" | tee -a "$LOG"
  wrap_up
  return $rc
}

# The summary and the archive of what has finished, redone after every phase: a command stopped from outside still
# returns the phases before.
wrap_up() {
  python3 tests/perf/issue42_summary.py "$R" > "$DEST/issue42_summary.txt" 2>&1
  cp "$LOG" "$R/" 2>/dev/null
  tar -czf "$DEST/issue42_targets.tar.gz" -C "$(dirname "$R")" "$(basename "$R")"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/gpu.txt" 2>/dev/null
git log -1 --format='%h %s' > "$R/commit.txt" 2>/dev/null
if [ -x "$LLB/bin/llama-bench" ] && [ -f "$W/mix_q4k_whole.gguf" ]; then
  phase depth_llama 150 env LLB="$LLB" bash tests/perf/compare_llamacpp.sh depth-llama
else
  echo "depth_llama: skipped (no $LLB/bin/llama-bench or no GGUF: run compare_llamacpp.sh depth-build)" | tee -a "$LOG"
fi
phase depth_moedesk 140 bash tests/perf/compare_llamacpp.sh depth-moedesk
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null  # the last bench's pinned RAM and page cache given back
# Started with 100 s left at least: the build, start-up and the first pair; its limit leaves 15 s to free 25 GB of
# pinned RAM and exit before the phase's timeout.
phase expert_cache 100 python3 tests/perf/bench_expert_cache.py --shape mixtral-8x7b --expert-format q4_k \
  --gpu-budget 16 --rounds "$ROUNDS" --intervals 16,1 --reuse-profile \
  --time-limit $((DEADLINE - SECONDS - 15)) --json "$R/expert_cache.json"

wrap_up
cat "$DEST/issue42_summary.txt"
