#!/usr/bin/env bash
# llama.cpp against moedesk on the same shapes and budgets, on the GPU box. Two phases so each
# fits one device command; run them back to back on the same machine:
#   SRC=.llamacpp TOOLS=.llamacpp-tools bash tests/perf/compare_llamacpp.sh llama     (build ~4 min + bench)
#   bash tests/perf/compare_llamacpp.sh moedesk                                        (our benches + ratios)
# SRC is the slim llama.cpp source from ../shared/tools/llamacpp/prepare.sh; TOOLS a copy of that
# folder's make_gguf.py. Mixtral-8x7B shape, first 8 layers, 16-bit weights, 16 threads.
set -uo pipefail
SRC=${SRC:-.llamacpp}; TOOLS=${TOOLS:-.llamacpp-tools}; L=${L:-8}; W=/tmp/compare; mkdir -p "$W"
OUT=${OUT:-$W/out}; mkdir -p "$OUT"
case "${1:-}" in
llama)
  (cd "$SRC" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
     -DGGML_NATIVE=ON > "$W/cfg.log" 2>&1 && cmake --build build --target llama-bench llama-batched-bench -j 15 \
     > "$W/build.log" 2>&1) &
  build=$!
  [ -f "$W/mix.gguf" ] || GGUF_PY="$SRC/gguf-py" python3 "$TOOLS/make_gguf.py" "$W/mix.gguf" "$L"
  wait $build || { tail -n 20 "$W/cfg.log" "$W/build.log"; exit 1; }
  bin="$SRC/build/bin"
  for ncm in "$L" $((L - 2)); do
    "$bin/llama-bench" -m "$W/mix.gguf" -ngl 99 -ncmoe "$ncm" -t 16 -p 512 -n 64 -r 2 -o json > "$W/llama_ncmoe$ncm.json"
  done
  "$bin/llama-batched-bench" -m "$W/mix.gguf" -ngl 99 -ncmoe "$L" -t 16 -c 8192 -b 2048 -ub 512 \
    -npp 128 -ntg 32 -npl 16 2>&1 | grep -E '^\|' | tee "$W/llama_batched.txt"
  cp "$W"/llama_* "$OUT"/ ;;
moedesk)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
  # 2 of 8 layers' experts: 16 experts of 352 MiB (0.336 GiB each) = 5.4 GiB.
  python3 -m app.cli bench --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --prefill 512 --json > "$W/ours_cpu.json"
  python3 -m app.cli bench --shape mixtral-8x7b --layers "$L" --gpu-budget 5.4 --prefill 512 --batch 1 --json > "$W/ours_2layers.json"
  cp "$W"/ours_* "$OUT"/
  [ -f "$W/llama_batched.txt" ] || { echo "no llama.cpp results in $W: run the llama phase first"; exit 1; }
  python3 - "$W" <<'PY'
import json, re, sys
w = sys.argv[1]
def llama(path):
    rows = json.load(open(path))
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
def ours(path):
    return {r["mode"]: r for r in json.load(open(path))["results"]}
batched = [l for l in open(f"{w}/llama_batched.txt") if re.match(r"\|\s+128", l)]
llama_b16 = float(batched[-1].split("|")[8]) if batched else None  # S_TG t/s column
rows = [("decode, all experts in RAM", ours(f"{w}/ours_cpu.json")["decode"], llama(f"{w}/llama_ncmoe8.json")["decode"]),
        ("decode, 2 of 8 layers on GPU", ours(f"{w}/ours_2layers.json")["decode"], llama(f"{w}/llama_ncmoe6.json")["decode"]),
        ("prefill 512, all in RAM", ours(f"{w}/ours_cpu.json")["prefill"], llama(f"{w}/llama_ncmoe8.json")["prefill"]),
        ("prefill 512, 2 of 8 layers on GPU", ours(f"{w}/ours_2layers.json")["prefill"], llama(f"{w}/llama_ncmoe6.json")["prefill"]),
        ("batched decode x16, all in RAM", ours(f"{w}/ours_cpu.json")["batched_decode"], llama_b16)]
print(f"{'case':<36}{'moedesk':>9}{'llama.cpp':>11}{'ratio':>7}{'bound':>8}{'% bound':>9}")
for name, r, ref in rows:
    ratio = f"{r['tok_s'] / ref:.2f}" if ref else "-"
    print(f"{name:<36}{r['tok_s']:>9.1f}{(ref or 0):>11.1f}{ratio:>7}{r['bound_tok_s']:>8.1f}{r['pct_of_bound'] or 0:>8.0f}%")
PY
  ;;
*) echo "usage: $0 llama|moedesk"; exit 2 ;;
esac
