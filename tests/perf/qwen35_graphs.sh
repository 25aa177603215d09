#!/usr/bin/env bash
# On the GPU box, from the repo root: Qwen3.5-MoE's decode through CUDA graphs (issue 41). The GPU tests that compare
# graphed and eager decoding for tiny Qwen3.5 and Qwen3-Next (greedy ids, logits, speculation's rollback); the decode
# profile with every expert on the GPU and all in RAM, graphed and eager (MOEDESK_NO_CUDA_GRAPHS=1); `moedesk bench`
# on the first 12 layers of Qwen3.5-35B-A3B, Q4_K experts in RAM, graphed and eager, for the llama.cpp comparison
# (tests/perf/families_vs_llamacpp.sh has llama.cpp's side).
# Usage: bash tests/perf/qwen35_graphs.sh [tests|profile|bench ...]   (writes to $OUT, default /tmp/out)
set -uo pipefail
. tests/perf/gpu_env.sh  # $OUT, and the wheels the box lacks (platformdirs: tests/conftest.py needs it)
which=${*:-tests profile bench}
for part in $which; do
  case $part in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_qwen3_next.py tests/kernels/test_gpu_delta_net.py \
             tests/kernels/test_gpu_fused_kernels.py 2>&1 \
             | tee "$OUT/pytest_qwen35_graphs.txt" | tail -25 ;;
    profile) for eager in 0 1; do
               MOEDESK_NO_CUDA_GRAPHS=$eager python3 tests/perf/profile_decode.py qwen3.5-35b-a3b:12 --variants gpu,native \
                 --expert-format q4_k 2>&1 | tee "$OUT/profile_qwen35_eager$eager.txt" | tail -6
             done ;;
    bench) for eager in 0 1; do
             MOEDESK_NO_CUDA_GRAPHS=$eager python3 -m moedesk bench --shape qwen3.5-35b-a3b --layers 12 --gpu-budget 0 \
               --expert-format q4_k --prefill 512 --decode-tokens 32 --batch 16 --json \
               > "$OUT/qwen35_bench_eager$eager.json" 2>>"$OUT/qwen35_bench.log" || echo "eager=$eager failed"
           done
           python3 - "$OUT" <<'PY'
import json, os, sys
for eager in (0, 1):
    try:
        d = json.load(open(os.path.join(sys.argv[1], f"qwen35_bench_eager{eager}.json")))
    except (OSError, ValueError):
        continue
    for r in d.get("results", []):
        print(f"{'eager' if eager else 'graphs':7} {r['mode']:15} batch {r['batch']:3} {r['tok_s']:9.1f} tok/s")
PY
           ;;
  esac
done
