#!/usr/bin/env bash
# On the GPU box, from the repo root: what issue 44's clean-up shared between copies, run where it matters.
# tests: the GPU tests of the dense grouped and zero-copy kernels (one bf16-rounding activation helper), of
#   speculation's captured graphs (the shared engines fixture), and the packed CPU kernel on this host's AMX/VNNI
#   (one int8 rounding, quantize32);
# bench: the two kernels' timings, to compare with the same command at the commit before (4c6cf7b^, 69468fa^).
# Usage: bash tests/perf/house_gpu.sh [tests|bench ...]   (writes to $OUT, default /tmp/out)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
which=${*:-tests bench}
for part in $which; do
  case $part in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_grouped_kernel.py \
             tests/kernels/test_gpu_zero_copy.py tests/kernels/test_gpu_quant_kernel.py \
             tests/speculative/test_speculative_graphs_gpu.py tests/model/test_gpt_oss_gpu.py \
             tests/model/test_gpu_equivalence.py::test_zero_copy_experts_match_all_on_gpu \
             tests/model/test_gpu_equivalence.py::test_split_width_match_all_on_gpu 2>&1 \
             | tee "$OUT/pytest_house_gpu.txt" | tail -25
           python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_quant_kernel.py \
             tests/kernels/test_cpu_quant_amx.py tests/kernels/test_cpu_quant_mxfp4.py -rs 2>&1 \
             | tee "$OUT/pytest_house_cpu_quant.txt" | tail -25 ;;
    bench) python3 tests/perf/bench_gpu_grouped.py 2>&1 | tee "$OUT/bench_gpu_grouped.txt"
           python3 tests/perf/bench_cpu_quant.py --formats q4_0,q4_k 2>&1 | tee "$OUT/bench_cpu_quant.txt" ;;
  esac
done
