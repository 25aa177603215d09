#!/usr/bin/env bash
# Issue 15's quantised-expert targets, moedesk against llama.cpp, in one run on the GPU box: three phases, one device
# command each, back to back on the same machine (docs/benchmarks.md, "Against llama.cpp"). The full comparison of
# every format and mode is tests/perf/compare_llamacpp.sh; this runs only the targets' cases, in ~12 minutes:
#   SRC=.llamacpp TOOLS=.llamacpp-tools bash tests/perf/compare_quant_targets.sh build   (llama.cpp, F16 GGUFs)
#   SRC=.llamacpp bash tests/perf/compare_quant_targets.sh llama     (llama-quantize: Qwen3 Q4_K_M; Mixtral Q4_0,
#                                                                     Q4_K_M, Q8_0; bench)
#   bash tests/perf/compare_quant_targets.sh moedesk                 (our packed and bf16 benches, then the ratios)
# Cases: Mixtral-8x7B shape (8 layers) Q4_0 decode, prefill 512 and 16 sequences, Q4_K and Q8_0 decode; Qwen3-30B-A3B
# shape (12 layers) Q4_K decode, twice; our bf16 Mixtral decode for the 4-bit / 16-bit ratio. Every expert in RAM,
# 16 threads. The last lines say which targets were met.
set -uo pipefail
SRC=${SRC:-.llamacpp}; TOOLS=${TOOLS:-.llamacpp-tools}; W=/tmp/compare; mkdir -p "$W"; OUT=${OUT:-$W/out}; mkdir -p "$OUT"
bin="$SRC/build/bin"
case "${1:-}" in
build)
  (cd "$SRC" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
     -DGGML_NATIVE=ON > "$W/cfg.log" 2>&1 \
   && cmake --build build --target llama-bench llama-batched-bench llama-quantize -j 15 > "$W/build.log" 2>&1) &
  build=$!
  GGUF_PY="$SRC/gguf-py" python3 "$TOOLS/make_gguf.py" "$W/mix.gguf" 8 > "$W/make_mix.log" 2>&1 &
  GGUF_PY="$SRC/gguf-py" python3 tests/perf/make_qwen3_gguf.py "$W/qwen3.gguf" 12 > "$W/make_qwen3.log" 2>&1
  wait %2 || { tail -n 5 "$W/make_mix.log"; exit 1; }
  wait $build || { tail -n 20 "$W/cfg.log" "$W/build.log"; exit 1; } ;;
llama)
  "$bin/llama-quantize" "$W/qwen3.gguf" "$W/qwen3_Q4_K_M.gguf" Q4_K_M 16 > "$W/quantize_qwen3.log" 2>&1 && rm -f "$W/qwen3.gguf"
  "$bin/llama-bench" -m "$W/qwen3_Q4_K_M.gguf" -ngl 99 -ncmoe 12 -t 16 -p 0 -n 64 -r 3 -o json > "$W/llamaq_qwen3_Q4_K_M.json"
  # The F16 Mixtral stays until its three quantised files are written (the box has 64 GB of disk: ~50 GB at most).
  for q in Q4_0 Q4_K_M Q8_0; do
    "$bin/llama-quantize" "$W/mix.gguf" "$W/mix_$q.gguf" "$q" 16 > "$W/quantize_$q.log" 2>&1
    prompt=0; [ "$q" = Q4_0 ] && prompt=512
    "$bin/llama-bench" -m "$W/mix_$q.gguf" -ngl 99 -ncmoe 8 -t 16 -p "$prompt" -n 64 -r 2 -o json > "$W/llamaq_mix_$q.json"
  done
  rm -f "$W/mix.gguf"
  "$bin/llama-batched-bench" -m "$W/mix_Q4_0.gguf" -ngl 99 -ncmoe 8 -t 16 -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 \
    -npl 16 2>&1 | grep -E '^\|' > "$W/llamaq_mix_Q4_0_batched.txt"
  cp "$W"/llamaq_* "$OUT"/ ;;
moedesk)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
  rm -f "$W"/*.gguf  # the page cache and the disk back for our banks
  clean() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "could not drop the page cache"; }
  b() { name=$1; shift; clean; python3 -m moedesk bench "$@" --decode-tokens 32 --json > "$W/oursq_$name.json"; }
  b qwen3_q4_k --shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --expert-format q4_k --prefill --batch 1
  b mix_q4_0 --shape mixtral-8x7b --layers 8 --gpu-budget 0 --expert-format q4_0 --prefill 512 --batch 16
  b mix_q4_k --shape mixtral-8x7b --layers 8 --gpu-budget 0 --expert-format q4_k --prefill --batch 1
  b mix_q8_0 --shape mixtral-8x7b --layers 8 --gpu-budget 0 --expert-format q8_0 --prefill --batch 1
  b mix_dense --shape mixtral-8x7b --layers 8 --gpu-budget 0 --prefill --batch 1
  b qwen3_q4_k_2 --shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --expert-format q4_k --prefill --batch 1
  cp "$W"/oursq_* "$OUT"/
  python3 tests/perf/quant_targets.py "$W"
  ;;
*) echo "usage: $0 build|llama|moedesk"; exit 2 ;;
esac
