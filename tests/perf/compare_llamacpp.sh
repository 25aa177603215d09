#!/usr/bin/env bash
# llama.cpp against moedesk on the same shapes and budgets, on the GPU box. Two phases so each
# fits one device command; run them back to back on the same machine:
#   SRC=.llamacpp TOOLS=.llamacpp-tools bash tests/perf/compare_llamacpp.sh llama     (build ~4 min + bench)
#   bash tests/perf/compare_llamacpp.sh moedesk                                        (our benches + ratios)
# Quantised experts, the same way (after the llama phase built llama.cpp and wrote the F16 GGUFs):
#   SRC=.llamacpp bash tests/perf/compare_llamacpp.sh llama-quant     (llama-quantize to Q4_0, Q4_K_M, Q8_0 + bench)
#   bash tests/perf/compare_llamacpp.sh moedesk-quant                  (our packed benches + ratios)
# Long contexts (issue 42.3), the whole Mixtral-8x7B shape with Q4_K experts at a 16 GiB budget, three commands:
#   SRC=.llamacpp bash tests/perf/compare_llamacpp.sh depth-build    (llama-bench with flash attention + the GGUF)
#   bash tests/perf/compare_llamacpp.sh depth-llama                  (llama-bench -fa 1 -d 512,8192,16384,32768)
#   bash tests/perf/compare_llamacpp.sh depth-moedesk                (bench --context at the same depths + ratios)
# (depth-llama and depth-moedesk run inside tests/perf/issue42_targets.sh too.) llama-bench is the one
# tests/perf/llamacpp_engine_gpu.sh build puts in $LLB (/tmp/llb: outside the carried .llamacpp, so later commands
# on the same machine keep it), flash attention compiled in as by default.
# SRC is a llama.cpp source tree and TOOLS a folder with make_gguf.py (docs/benchmarks.md, "Against
# llama.cpp"). Mixtral-8x7B shape, first 8 layers, and Qwen3-30B-A3B shape, first 12 layers
# (tests/perf/make_qwen3_gguf.py), 16-bit weights, 16 threads.
set -uo pipefail
SRC=${SRC:-.llamacpp}; TOOLS=${TOOLS:-.llamacpp-tools}; L=${L:-8}; QL=${QL:-12}; W=/tmp/compare; mkdir -p "$W"
OUT=${OUT:-$W/out}; mkdir -p "$OUT"
case "${1:-}" in
llama)
  (cd "$SRC" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
     -DGGML_NATIVE=ON > "$W/cfg.log" 2>&1 && cmake --build build --target llama-bench llama-batched-bench -j 15 \
     > "$W/build.log" 2>&1) &
  build=$!
  [ -f "$W/mix.gguf" ] || GGUF_PY="$SRC/gguf-py" python3 "$TOOLS/make_gguf.py" "$W/mix.gguf" "$L"
  [ -f "$W/qwen3.gguf" ] || GGUF_PY="$SRC/gguf-py" python3 tests/perf/make_qwen3_gguf.py "$W/qwen3.gguf" "$QL"
  wait $build || { tail -n 20 "$W/cfg.log" "$W/build.log"; exit 1; }
  bin="$SRC/build/bin"
  for ncm in "$L" $((L - 2)); do
    "$bin/llama-bench" -m "$W/mix.gguf" -ngl 99 -ncmoe "$ncm" -t 16 -p 512 -n 64 -r 2 -o json > "$W/llama_ncmoe$ncm.json"
    cp "$W"/llama_* "$OUT"/  # as they come: a run cut short keeps what it measured
  done
  "$bin/llama-batched-bench" -m "$W/mix.gguf" -ngl 99 -ncmoe "$L" -t 16 -c 8192 -b 2048 -ub 512 \
    -npp 128 -ntg 32 -npl 16 2>&1 | grep -E '^\|' | tee "$W/llama_batched.txt"
  for ncm in "$QL" $((QL * 3 / 4)); do
    "$bin/llama-bench" -m "$W/qwen3.gguf" -ngl 99 -ncmoe "$ncm" -t 16 -p 512 -n 64 -r 2 -o json > "$W/llama_qwen3_ncmoe$ncm.json"
    cp "$W"/llama_* "$OUT"/
  done
  "$bin/llama-batched-bench" -m "$W/qwen3.gguf" -ngl 99 -ncmoe "$QL" -t 16 -c 8192 -b 2048 -ub 512 \
    -npp 128 -ntg 32 -npl 16 2>&1 | grep -E '^\|' | tee "$W/llama_qwen3_batched.txt"
  cp "$W"/llama_* "$OUT"/ ;;
moedesk)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
  # The llama phase leaves ~40 GB of GGUF files in the page cache; pinning our banks then kept the kernel
  # compacting memory (kcompactd busy) and one run's Qwen3 decode fell from ~70 to 38 tok/s. Each bench
  # starts with a clean page cache.
  clean() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "could not drop the page cache"; }
  # A budget is the whole GPU's (bench/budget.py): the one holding 2 of 8 layers' experts (16) beside the weights
  # and the cache of the 576 positions these runs build, and the one holding a quarter of Qwen3's (3 x 128).
  two=$(python3 -m moedesk.bench.budget mixtral-8x7b "$L" 16 576); quarter=$(python3 -m moedesk.bench.budget qwen3-30b-a3b "$QL" $((QL * 32)) 576)
  clean; python3 -m moedesk bench --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --prefill 512 --json > "$W/ours_cpu.json"
  clean; python3 -m moedesk bench --shape mixtral-8x7b --layers "$L" --gpu-budget "$two" --prefill 512 --batch 1 --json > "$W/ours_2layers.json"
  clean; python3 -m moedesk bench --shape qwen3-30b-a3b --layers "$QL" --gpu-budget 0 --prefill 512 --json > "$W/ours_qwen3_cpu.json"
  clean; python3 -m moedesk bench --shape qwen3-30b-a3b --layers "$QL" --gpu-budget "$quarter" --prefill 512 --batch 1 --json \
    > "$W/ours_qwen3_quarter.json"
  cp "$W"/ours_* "$OUT"/
  [ -f "$W/llama_batched.txt" ] || { echo "no llama.cpp results in $W: run the llama phase first"; exit 1; }
  python3 - "$W" <<'PY'
import json, os, re, sys
w = sys.argv[1]
def llama(path):
    rows = json.load(open(path))
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
def ours(path):
    return {r["mode"]: r for r in json.load(open(path))["results"]}
def batched16(path):  # llama-batched-bench's S_TG t/s column on the 16-sequence row
    rows = [l for l in open(path) if re.match(r"\|\s+128", l)]
    return float(rows[-1].split("|")[8]) if rows else None
cpu, two = ours(f"{w}/ours_cpu.json"), ours(f"{w}/ours_2layers.json")
q_cpu, q_quarter = ours(f"{w}/ours_qwen3_cpu.json"), ours(f"{w}/ours_qwen3_quarter.json")
ql = max(int(re.search(r"ncmoe(\d+)", p).group(1)) for p in os.listdir(w) if p.startswith("llama_qwen3_ncmoe"))
q_all, q_part = llama(f"{w}/llama_qwen3_ncmoe{ql}.json"), llama(f"{w}/llama_qwen3_ncmoe{ql * 3 // 4}.json")
rows = [("Mixtral decode, all experts in RAM", cpu["decode"], llama(f"{w}/llama_ncmoe8.json")["decode"]),
        ("Mixtral decode, 2 of 8 layers on GPU", two["decode"], llama(f"{w}/llama_ncmoe6.json")["decode"]),
        ("Mixtral prefill 512, all in RAM", cpu["prefill"], llama(f"{w}/llama_ncmoe8.json")["prefill"]),
        ("Mixtral prefill 512, 2 layers on GPU", two["prefill"], llama(f"{w}/llama_ncmoe6.json")["prefill"]),
        ("Mixtral batched x16, all in RAM", cpu["batched_decode"], batched16(f"{w}/llama_batched.txt")),
        ("Qwen3 decode, all experts in RAM", q_cpu["decode"], q_all["decode"]),
        ("Qwen3 decode, 1/4 of layers on GPU", q_quarter["decode"], q_part["decode"]),
        ("Qwen3 prefill 512, all in RAM", q_cpu["prefill"], q_all["prefill"]),
        ("Qwen3 batched x16, all in RAM", q_cpu["batched_decode"], batched16(f"{w}/llama_qwen3_batched.txt"))]
print(f"{'case':<38}{'moedesk':>9}{'llama.cpp':>11}{'ratio':>7}{'bound':>8}{'% bound':>9}")
for name, r, ref in rows:
    ratio = f"{r['tok_s'] / ref:.2f}" if ref else "-"
    print(f"{name:<38}{r['tok_s']:>9.1f}{(ref or 0):>11.1f}{ratio:>7}{r['bound_tok_s']:>8.1f}{r['pct_of_bound'] or 0:>8.0f}%")
PY
  ;;
llama-quant)
  # Quantised by llama.cpp's own llama-quantize, Qwen3 first: the box has 64 GB of disk, so each F16 file goes
  # once quantised (the llama phase must run again to write them for a second pass).
  bin="$SRC/build/bin"
  [ -x "$bin/llama-quantize" ] || (cd "$SRC" && cmake --build build --target llama-quantize -j 15 > "$W/build_q.log" 2>&1) \
    || { tail -n 20 "$W/build_q.log"; exit 1; }
  [ -f "$W/mix.gguf" ] && [ -f "$W/qwen3.gguf" ] || { echo "run the llama phase first (it writes the F16 GGUFs)"; exit 1; }
  "$bin/llama-quantize" "$W/qwen3.gguf" "$W/qwen3_Q4_K_M.gguf" Q4_K_M 16 > "$W/quantize_qwen3.log" 2>&1 && rm -f "$W/qwen3.gguf"
  "$bin/llama-bench" -m "$W/qwen3_Q4_K_M.gguf" -ngl 99 -ncmoe "$QL" -t 16 -p 512 -n 64 -r 2 -o json > "$W/llamaq_qwen3_Q4_K_M.json"
  for q in Q4_0 Q4_K_M Q8_0; do
    "$bin/llama-quantize" "$W/mix.gguf" "$W/mix_$q.gguf" "$q" 16 > "$W/quantize_$q.log" 2>&1
    "$bin/llama-bench" -m "$W/mix_$q.gguf" -ngl 99 -ncmoe "$L" -t 16 -p 512 -n 64 -r 2 -o json > "$W/llamaq_mix_$q.json"
    [ "$q" = Q8_0 ] || "$bin/llama-batched-bench" -m "$W/mix_$q.gguf" -ngl 99 -ncmoe "$L" -t 16 -c 8192 -b 2048 -ub 512 \
      -npp 128 -ntg 32 -npl 16 2>&1 | grep -E '^\|' > "$W/llamaq_mix_${q}_batched.txt"
    cp "$W"/llamaq_* "$OUT"/
  done
  rm -f "$W/mix.gguf" ;;
moedesk-quant)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
  clean() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "could not drop the page cache"; }
  rm -f "$W"/*.gguf  # the page cache and the disk back for our banks
  # q4_0 for every target (decode, prefill 512, 16 sequences); the others decode only. llama.cpp's Q4_K_M gives
  # the experts q4_k (and q6_k for some down projections): q4_k is ours to compare. bf16: the 16-bit decode the
  # 4-bit one is compared with, and the batched decode of 16 that `moedesk serve` is compared with.
  b() { name=$1; shift; clean; python3 -m moedesk bench "$@" --decode-tokens 32 --json > "$W/oursq_$name.json"; }
  b mix_q4_0 --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --expert-format q4_0 --prefill 512 --batch 16
  b mix_q4_k --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --expert-format q4_k --prefill --batch 1
  b mix_q8_0 --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --expert-format q8_0 --prefill --batch 1
  b qwen3_q4_k --shape qwen3-30b-a3b --layers "$QL" --gpu-budget 0 --expert-format q4_k --prefill --batch 1
  b mix_dense --shape mixtral-8x7b --layers "$L" --gpu-budget 0 --prefill --batch 16
  cp "$W"/oursq_* "$OUT"/
  python3 - "$W" <<'PY'
import json, re, sys
w = sys.argv[1]
def llama(path):
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.load(open(path))}
def ours(path):
    return {r["mode"]: r for r in json.load(open(path))["results"]}
def batched16(path):
    rows = [l for l in open(path) if re.match(r"\|\s+128", l)]
    return float(rows[-1].split("|")[8]) if rows else None
dense = ours(f"{w}/oursq_mix_dense.json")
def batched(name):
    try:
        return batched16(f"{w}/llamaq_mix_{name}_batched.txt")
    except FileNotFoundError:
        return None
print(f"{'case':<34}{'moedesk':>9}{'llama.cpp':>11}{'ratio':>7}{'% bound':>9}{'x our bf16':>11}")
cases = [(f"Mixtral {f}", ours(f"{w}/oursq_mix_{f}.json"), llama(f"{w}/llamaq_mix_{t}.json"), batched(t))
         for f, t in (("q4_0", "Q4_0"), ("q4_k", "Q4_K_M"), ("q8_0", "Q8_0"))]
cases.append(("Qwen3 q4_k", ours(f"{w}/oursq_qwen3_q4_k.json"), llama(f"{w}/llamaq_qwen3_Q4_K_M.json"), None))
for name, o, t, b16 in cases:
    for mode, r in o.items():  # the modes this bench ran
        ref = b16 if mode == "batched_decode" else t.get(mode)
        x16 = f"{r['tok_s'] / dense[mode]['tok_s']:.2f}" if name.startswith("Mixtral") and mode in dense else "-"
        print(f"{name + ' ' + mode:<34}{r['tok_s']:>9.1f}{(ref or 0):>11.1f}{(r['tok_s'] / ref if ref else 0):>7.2f}"
              f"{r['pct_of_bound'] or 0:>8.0f}%{x16:>11}")
PY
  ;;
depth-build)
  # Predicted, not measured on the box: building llama-bench with CUDA and flash attention, ~4-5 min on 15 cores,
  # unless $LLB has it (llamacpp_engine_gpu.sh build ran first: then the GGUF alone); beside it the 26 GB GGUF,
  # written at the disk's speed (the script prints its rate): ~165 s at a slow virtual disk's 160 MB/s, 30-90 s on
  # NVMe. So ~300 s at most: one device command.
  . tests/perf/gpu_env.sh  # the GGUF writer needs gguf, which the box lacks
  LLB=${LLB:-/tmp/llb}
  if [ -x "$LLB/bin/llama-bench" ]; then
    build=
  else  # configured as llamacpp_engine_gpu.sh build configures it, so either build goes on from the other's
    (cmake -S "$SRC" -B "$LLB" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
       -DLLAMA_CURL=OFF -DGGML_NATIVE=ON > "$W/cfg_fa.log" 2>&1 && cmake --build "$LLB" --target llama-bench -j 15 \
       > "$W/build_fa.log" 2>&1) &
    build=$!
  fi
  [ -f "$W/mix_q4k_whole.gguf" ] || { python3 tests/perf/make_mixtral_q4k_gguf.py "$W/mix_q4k_whole.partial" 32 \
    > "$W/gguf_whole.log" 2>&1 && mv "$W/mix_q4k_whole.partial" "$W/mix_q4k_whole.gguf"; }
  tail -n 1 "$W/gguf_whole.log" 2>/dev/null
  [ -z "$build" ] || wait $build || { tail -n 20 "$W/cfg_fa.log" "$W/build_fa.log"; exit 1; }
  ls -l "$W/mix_q4k_whole.gguf" "$LLB/bin/llama-bench" ;;
depth-llama)
  # -ncmoe: the layers whose experts the 16 GiB left no room for once weights, the 32k KV cache and attention's
  # workspace are counted (bench/budget.py, as our bench places them), as whole layers.
  export PYTHONPATH=${PYTHONPATH:-}:.
  LLB=${LLB:-/tmp/llb}
  ncm=$(python3 -m moedesk.bench.budget --ncmoe mixtral-8x7b 0 16 $((32768 + 512 + 1)) q4_k)
  echo "llama-bench -ncmoe $ncm (16 GiB at 32k)"
  "$LLB/bin/llama-bench" -m "$W/mix_q4k_whole.gguf" -ngl 99 -ncmoe "$ncm" -fa 1 -t 16 -p 512 -n 64 \
    -d 512,8192,16384,32768 -r 1 -o json > "$W/llama_depth.json"
  cp "$W/llama_depth.json" "$OUT"/ ;;
depth-moedesk)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
  rm -f "$W"/*.gguf  # the page cache and the disk back for our banks
  python3 -m moedesk bench --shape mixtral-8x7b --expert-format q4_k --gpu-budget 16 --prefill 512 --batch 1 \
    --context 512 8192 16384 32768 --json > "$W/ours_depth.json"
  cp "$W/ours_depth.json" "$OUT"/
  python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
ours = {(r["mode"], r["depth"]): r["tok_s"] for r in json.load(open(f"{w}/ours_depth.json"))["results"]}
try:
    theirs = {("prefill" if r["n_prompt"] else "decode", r["n_depth"]): r["avg_ts"]
              for r in json.load(open(f"{w}/llama_depth.json"))}
except FileNotFoundError:
    theirs = {}
print(f"{'depth':>6}{'decode':>9}{'llama':>8}{'ratio':>7}{'vs 512':>8}{'prefill 512':>13}{'llama':>8}{'ratio':>7}")
for d in (512, 8192, 16384, 32768):
    dec, pre = ours[("decode", d)], ours[("prefill", d)]
    ld, lp = theirs.get(("decode", d)), theirs.get(("prefill", d))
    print(f"{d:>6}{dec:>9.1f}{ld or 0:>8.1f}{dec / ld if ld else 0:>7.2f}{dec / ours[('decode', 512)]:>8.2f}"
          f"{pre:>13.1f}{lp or 0:>8.1f}{pre / lp if lp else 0:>7.2f}")
PY
  ;;
*) echo "usage: $0 llama|moedesk|llama-quant|moedesk-quant|depth-build|depth-llama|depth-moedesk"; exit 2 ;;
esac
