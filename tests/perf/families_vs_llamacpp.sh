#!/usr/bin/env bash
# On the GPU box, from the repo root: issue 41's targets, each 2026 family's real shape (its first layers, every
# expert in RAM) through llama.cpp and through moedesk in one run, in the issue's formats.
#   bash tests/perf/families_vs_llamacpp.sh [glm|gpt-oss|deepseek|qwen35|minimax ...]
# Needs llama-bench and llama-batched-bench built with CUDA in $LLB (tests/perf/llamacpp_engine_gpu.sh build).
# The box's 64 GB disk holds one family's GGUF at a time: each is written, benched by llama.cpp and deleted
# before ours runs (ours builds the same shape in RAM: engine/load/synthetic.py). ENGINE_ON=glm-4.5-air also runs
# tests/perf/compare_llamacpp_engine.py (issue 40: moedesk's llama.cpp engine against llama-bench) on that file.
set -uo pipefail
# Results gather in $R; after each family its summary table and one archive of them are put in $OUT (the device
# hands back a few files per run, and a run cut at its time limit keeps the families done so far).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LLB=${LLB:-/tmp/llb/bin}; W=/tmp/families; R=$W/results; mkdir -p "$R"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# llama-cpp-python's package (.pylib) over the CUDA libraries built in $LLB/..: prompt_picks.py counts through it,
# and ENGINE_ON's comparison runs on it.
if [ -d .pylib/llama_cpp ]; then . tests/perf/llamacpp_libs.sh && install_llamacpp_libs "$LLB/.."; fi
clean() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
family() {  # name shape layers our-format gguf-experts
  local name=$1 shape=$2 L=$3 fmt=$4 gexp=$5 f="$W/$1.gguf"
  python3 tests/perf/make_family_gguf.py "$shape" "$f" "$L" --experts "$gexp" > "$R/${name}_write.log" 2>&1 \
    || { echo "$name: GGUF not written"; tail -n 3 "$R/${name}_write.log"; return; }
  "$LLB/llama-bench" -m "$f" -ngl 99 -ncmoe "$L" -t 16 -fa 1 -p 512 -n 64 -r 2 -o json > "$R/${name}_llama.json" \
    2> "$R/${name}_llama.err" || echo "$name: llama-bench failed"
  # The file read instead of mapped: experts in RAM then sit in page-locked memory, which its prefill copies to the
  # GPU far faster (docs/measurements.md, "Session 46"); the summary compares with llama.cpp's better of the two.
  "$LLB/llama-bench" -m "$f" -ngl 99 -ncmoe "$L" -t 16 -fa 1 -p 512 -n 64 -r 2 -lm none -o json \
    > "$R/${name}_llama_read.json" 2> "$R/${name}_llama_read.err" || echo "$name: llama-bench -lm none failed"
  "$LLB/llama-batched-bench" -m "$f" -ngl 99 -ncmoe "$L" -t 16 -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 -npl 16 \
    2>&1 | grep -E '^\|' > "$R/${name}_llama_batched.txt"
  if [ -n "${ENGINE_ON:-}" ] && [ "$name" = "$ENGINE_ON" ]; then  # issue 40: the llama.cpp engine on this file
    python3 tests/perf/compare_llamacpp_engine.py --llama-bench "$LLB/llama-bench" --gguf "$f" --budgets "${BUDGETS:-6}" \
      --json "$R/llamacpp_engine.json" > "$R/llamacpp_engine.txt" 2>&1 || echo "llama.cpp engine compare failed"
    tail -n 4 "$R/llamacpp_engine.txt"
  fi
  # How many experts llama.cpp's prompt picks, which is what its prefill copies (counted on the CPU)
  timeout 300 python3 tests/perf/prompt_picks.py "$f" --json "$R/${name}_picks.json" > "$R/${name}_picks.log" 2>&1 \
    || echo "$name: the prompt's picks not counted"
  # Ours on the very file llama-bench read (bench --gguf): its routers pick the experts llama.cpp's pick, where a
  # random model of the shape routes otherwise (docs/measurements.md, "Session 50"). FILE_BENCH=0 skips it.
  clean
  [ "${FILE_BENCH:-1}" = 0 ] || timeout 600 python3 -m moedesk bench --gguf "$f" --gpu-budget 0 --prefill 512 \
    --decode-tokens 32 --batch 16 --json > "$R/${name}_file.json" 2> "$R/${name}_file.err" \
    || echo "$name: ours on the file failed"
  rm -f "$f"; clean
  python3 -m moedesk bench --shape "$shape" --layers "$L" --gpu-budget 0 --expert-format "$fmt" --prefill 512 \
    --decode-tokens 32 --batch 16 --json > "$R/${name}_ours.json" 2> "$R/${name}_ours.err" || echo "$name: ours failed"
}
summary() {
  python3 - "$R" > "$OUT/summary.txt" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
def load(path, parse):
    try:
        return parse(path)
    except (OSError, ValueError, KeyError, IndexError):
        return None
def llama(path):
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.load(open(path))}
def batched16(path):  # llama-batched-bench's S_TG t/s column on the 16-sequence row
    return float([l for l in open(path) if re.match(r"\|\s+128", l)][-1].split("|")[8])
def ours(path):
    return {r["mode"]: r for r in json.load(open(path))["results"]}
# moedesk on the shape built in memory and on llama.cpp's own file (bench --gguf); llama.cpp: llama-bench's default
# (the file mapped) and read (-lm none); the ratios over the better of those two
print(f"{'family':<15}{'case':<14}{'moedesk':>9}{'on file':>9}{'mapped':>9}{'read':>9}{'ratio':>7}{'on file':>8}"
      f"{'% bound':>9}")
for f in sorted(glob.glob(os.path.join(out, "*_ours.json"))):
    name = os.path.basename(f)[:-len("_ours.json")]
    mine, on_file = load(f, ours) or {}, load(f"{out}/{name}_file.json", ours) or {}
    theirs = load(f"{out}/{name}_llama.json", llama) or {}
    read = load(f"{out}/{name}_llama_read.json", llama) or {}
    theirs["batched_decode"] = load(f"{out}/{name}_llama_batched.txt", batched16)
    for mode in ("decode", "prefill", "batched_decode"):
        r, same, ref, other = mine.get(mode), on_file.get(mode), theirs.get(mode), read.get(mode)
        if r is None and same is None:
            continue
        best = max(ref or 0, other or 0)
        ratio = lambda x: f"{x['tok_s'] / best:.2f}" if x and best else "-"
        tok_s = lambda x: x["tok_s"] if x else 0
        print(f"{name:<15}{mode:<14}{tok_s(r):>9.1f}{tok_s(same):>9.1f}{(ref or 0):>9.1f}{(other or 0):>9.1f}"
              f"{ratio(r):>7}{ratio(same):>8}{((r or {}).get('pct_of_bound') or 0):>8.0f}%")
    # the experts a 512-token prompt used on each side: llama.cpp's prefill copies those it uses
    picks = load(f"{out}/{name}_picks.json", lambda p: json.load(open(p)))
    used = lambda run: (f"{run['experts']['active_experts'] / run['rounds']:.0f}"
                        if run and run.get("experts") else "-")
    if picks:
        print(f"{name:<15}experts a prompt used: llama.cpp's file {sum(picks['used'])}, ours {used(mine.get('prefill'))}, "
              f"ours on the file {used(on_file.get('prefill'))}, of {sum(picks['experts'])}")
PY
  tar czf "$OUT/families.tgz" -C "$R" .
}
for which in ${*:-glm gpt-oss deepseek qwen35 minimax}; do
  case $which in
    glm) family glm-4.5-air glm-4.5-air 12 q4_k q4_k ;;
    gpt-oss) family gpt-oss-120b gpt-oss-120b 8 mxfp4 mxfp4 ;;
    deepseek) family deepseek-v3 deepseek-v3 8 q4_k q4_k ;;
    qwen35) family qwen3.5-35b-a3b qwen3.5-35b-a3b 12 q4_k q4_k ;;
    minimax) family minimax-m2 minimax-m2 8 q4_k q4_k ;;
  esac
  summary
done
cat "$OUT/summary.txt"
