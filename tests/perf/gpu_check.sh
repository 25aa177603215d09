#!/usr/bin/env bash
# On the GPU box, from the repo root: the GPU test subset, then the benchmarks of the offload engine.
# Usage: bash tests/perf/gpu_check.sh [quick]   (needs $OUT; wheels in .whl when packages are missing)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_gpu_equivalence.py tests/kernels/test_gpu_experts_kernel.py tests/offload/test_gpu_profiler.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
python3 tests/perf/bench_cpu_experts.py --quick > "$OUT/cpu_experts_kernel.txt" 2>&1 || echo "kernel bench failed"
tail -n 25 "$OUT/cpu_experts_kernel.txt"
run() { name=$1; shift; python3 -m moedesk bench "$@" --json > "$OUT/$name.json" 2>>"$OUT/bench.log" || echo "$name failed"; }
run mixtral_cpu_balanced --shape mixtral-8x7b --layers 8 --gpu-budget 0
run mixtral_cpu_fiddler --shape mixtral-8x7b --layers 8 --gpu-budget 0 --policy fiddler --batch 1 --prefill 512
# the whole-GPU budget (bench/budget.py) that holds 2 of the 8 layers' experts beside the weights and the cache
run mixtral_2layers --shape mixtral-8x7b --layers 8 --gpu-budget "$(python3 -m moedesk.bench.budget mixtral-8x7b 8 16 576)" \
  --batch 1 --prefill 512
run qwen3_cpu --shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --prefill 512
python3 - "$OUT" <<'PY'
import json, sys, os
for name in ("mixtral_cpu_balanced", "mixtral_cpu_fiddler", "mixtral_2layers", "qwen3_cpu"):  # not another script's
    f = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(f):
        continue
    d = json.load(open(f))
    for r in d["results"]:
        b = r["bound_tok_s"]
        print(f"{name:<22}{r['mode']:<15}{r['tokens']:>6}{r['batch']:>4}{r['tok_s']:>9.1f}"
              f"{(b or 0):>9.1f}{(r['pct_of_bound'] or 0):>6.0f}%")
PY
