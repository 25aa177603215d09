#!/usr/bin/env bash
# On the GPU box, from the repo root: llama-cpp-python built with CUDA the way a user builds it (pip, its own CMake,
# CMAKE_ARGS="-DGGML_CUDA=on"), into /tmp/site-cuda, then a tiny GGUF loaded with every layer on the GPU, without
# and after torch's CUDA (the loads through our own llama.cpp build next to .pylib's bindings segfaulted in session
# 33 and 34: docs/measurements.md), then issue 40's GPU tests on it.
#   bash tests/perf/llamacpp_python_cuda.sh build     ~5 min predicted (llama.cpp's CUDA kernels on 14 jobs)
#   bash tests/perf/llamacpp_python_cuda.sh probe     the loads and the GPU tests (~1 min)
# Carry .whl (scikit-build-core and its two dependencies beside the usual wheels), .llamacpp (llama.cpp's source:
# llama-cpp-python 0.3.36's vendor/llama.cpp, pruned) and .llamacpp-py (the rest of that sdist, without vendor/).
set -uo pipefail
. tests/perf/gpu_env.sh
S=/tmp/site-cuda W=/tmp/lcp
case "${1:-}" in
build)
  rm -rf "$W" && mkdir -p "$W" && cp -r .llamacpp-py/. "$W"/ && mkdir -p "$W/vendor" && cp -r .llamacpp "$W/vendor/llama.cpp"
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off" CMAKE_BUILD_PARALLEL_LEVEL=14 \
    python3 -m pip install --no-build-isolation --no-index --no-deps --no-cache-dir --target "$S" "$W" \
    > "$OUT/pip_build.log" 2>&1 && echo "llama-cpp-python built with CUDA into $S" \
    || { tail -n 40 "$OUT/pip_build.log"; exit 1; }
  ls "$S/llama_cpp/lib" ;;
probe)
  export PYTHONPATH=$S:$PYTHONPATH PYTHONFAULTHANDLER=1
  python3 -c "from tests.load.test_packed_experts import write_f32_moe; write_f32_moe('/tmp/probe_f32.gguf', 'llama', L=3)" \
    || exit 1
  load="import llama_cpp; m = llama_cpp.Llama('/tmp/probe_f32.gguf', n_gpu_layers=99, verbose=False); print(m('the', max_tokens=4)['choices'][0]['text'])"
  for case in "without torch|$load" "after torch's CUDA|import torch; torch.zeros(1, device='cuda'); $load" \
      "moedesk's engine|from moedesk.engine.runtime import Engine; e = Engine.load('/tmp/probe_f32.gguf', engine='llama.cpp', device='auto', context_length=64); print(e.device, e.warnings)"; do
    python3 -c "${case#*|}" > /tmp/probe_case.log 2>&1; echo "${case%%|*}: exit $?"; tail -n 3 /tmp/probe_case.log | cut -c1-300
  done
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/llamacpp 2>&1 | tee "$OUT/pytest_llamacpp_gpu.txt" | tail -n 8 ;;
*) echo "usage: $0 build|probe"; exit 2 ;;
esac
