#!/usr/bin/env bash
# On the GPU box, from the repo root: issue 40's targets for the llama.cpp engine, in two phases on one machine.
#   bash tests/perf/llamacpp_engine_gpu.sh build     llama.cpp with CUDA (shared libraries + llama-bench) into /tmp/llb,
#                                                      while `pytest -m gpu` runs (about 5 min)
#   bash tests/perf/llamacpp_engine_gpu.sh compare   the engine's GPU tests, then tests/perf/compare_llamacpp_engine.py,
#                                                      on the built libraries
# Needs .llamacpp (a llama.cpp source tree: docs/benchmarks.md, "Against llama.cpp") and .pylib/llama_cpp, the
# llama-cpp-python package of the same version without its libraries: the CUDA ones built here are put beside it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; B=/tmp/llb
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
case "${1:-}" in
build)
  (cmake -S .llamacpp -B "$B" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
     > "$OUT/cfg.log" 2>&1 && cmake --build "$B" --target llama llama-bench llama-batched-bench -j 14 > "$OUT/build.log" 2>&1) &
  build=$!
  [ -n "${NOTEST:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests > "$OUT/pytest_gpu.txt" 2>&1
  tail -n 25 "$OUT/pytest_gpu.txt"
  wait $build && echo "llama.cpp built" || { tail -n 30 "$OUT/cfg.log" "$OUT/build.log"; exit 1; } ;;
compare)
  # LLAMA_SITE=/tmp/site-cuda: llama-cpp-python as pip built it with CUDA (llamacpp_python_cuda.sh), else our build's
  # libraries beside .pylib's bindings
  if [ -n "${LLAMA_SITE:-}" ]; then export PYTHONPATH=$LLAMA_SITE:$PYTHONPATH; else
    . tests/perf/llamacpp_libs.sh && install_llamacpp_libs "$B"; fi
  python3 -c "import llama_cpp; print('llama.cpp GPU offload:', llama_cpp.llama_supports_gpu_offload())"
  # The llama.cpp engine's GPU tests need these CUDA libraries: pinned experts read back, counts from GPU memory, a
  # context that runs out of GPU memory backing off.
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/llamacpp/test_overrides.py tests/llamacpp/test_expert_counts.py \
    tests/llamacpp/test_context_backoff.py \
    2>&1 | tee "$OUT/pytest_llamacpp_gpu.txt" | tail -n 5
  # The placement's estimate against llama.cpp's own GPU buffers (a run of its own: an abort above stops no more).
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/llamacpp/test_compute_buffer.py tests/llamacpp/test_fit_agreement.py \
    tests/llamacpp/test_recurrent_state.py \
    2>&1 | tee "$OUT/pytest_llamacpp_fit.txt" | tail -n 5
  python3 tests/perf/compare_llamacpp_engine.py --llama-bench "$B/bin/llama-bench" --shape mixtral-8x7b --layers 8 \
    --expert-format q4_k --budgets "${BUDGETS:-3,5}" --count-every "${COUNT_EVERY:-8}" --reps "${REPS:-3}" \
    --batched-bench "$B/bin/llama-batched-bench" --json "$OUT/llamacpp_engine.json" 2>&1 | tee "$OUT/compare.txt"
  # Serve with every expert in RAM (0) and with every expert on the GPU (10 GiB holds the 7.25 GB file): four rows
  # of top-2 read most of a layer's experts, so only the second can show four streams' gain over one.
  gguf=$(python3 -c "import json; print(json.load(open('$OUT/llamacpp_engine.json'))['gguf'])") && \
    for budget in ${SERVE_BUDGETS:-0 10}; do
      python3 tests/perf/bench_serve.py --model "$gguf" --engine llama.cpp --clients 4 --gpu-budget "$budget" 2>&1 \
        | tee "$OUT/serve_$budget.txt" | tail -n 8
    done ;;
*) echo "usage: $0 build|compare"; exit 2 ;;
esac
