#!/usr/bin/env bash
# On the GPU box, from the repo root: gpt-oss's experts on the GPU (issue 41 item 1): the GPU tests of the MXFP4 and
# biased-expert kernels and of gpt-oss's engine on CUDA, the kernels' timings at gpt-oss-120b's expert shape, and
# `moedesk bench` on its first 8 layers with every expert resident, about a third of them, and none (copied at
# prefill). Usage: bash tests/perf/gpt_oss_gpu.sh [tests|kernels|bench ...]   (writes to $OUT, default /tmp/out)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
which=${*:-tests kernels bench}
for part in $which; do
  case $part in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_quant_kernel.py \
             tests/kernels/test_gpu_experts_kernel.py tests/kernels/test_gpu_grouped_kernel.py \
             tests/kernels/test_gpu_zero_copy.py tests/model/test_gpt_oss_gpu.py \
             "tests/model/test_gpu_equivalence.py::test_bf16_greedy_on_cuda[gpt_oss]" 2>&1 \
             | tee "$OUT/pytest_gpt_oss_gpu.txt" | tail -25 ;;
    kernels) python3 tests/perf/bench_gpu_quant.py --no-sweep --shapes gpt-oss --formats mxfp4,q4_0,q8_0 2>&1 \
               | tee "$OUT/bench_gpu_quant_gpt_oss.txt" ;;
    bench) for experts in 1024 341 0; do  # of the 8 layers' 1024: a whole-GPU budget holding them (bench/budget.py)
             budget=$( ((experts)) && python3 -m moedesk.bench.budget gpt-oss-120b 8 $experts 544 mxfp4 || echo 0)
             python3 -m moedesk bench --shape gpt-oss-120b --layers 8 --expert-format mxfp4 --gpu-budget $budget \
               --prefill 512 --decode-tokens 32 --batch 16 --json > "$OUT/gpt-oss-120b_mxfp4_experts$experts.json" \
               2>>"$OUT/gpt_oss_bench.log" || echo "$experts experts ($budget GiB) failed (see $OUT/gpt_oss_bench.log)"
           done
           python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "gpt-oss-120b_mxfp4_experts*.json"))):
    try:
        d = json.load(open(f))
    except (OSError, ValueError):
        continue
    for r in d.get("results", []):
        print(f"{os.path.basename(f)[:-5]:32} {r['mode']:15} batch {r['batch']:3} {r['tok_s']:9.1f} tok/s"
              f"  bound {r.get('bound_tok_s')}")
PY
           grep -h "placement:" "$OUT/gpt_oss_bench.log" | tail -3 ;;
  esac
done
