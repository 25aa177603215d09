#!/usr/bin/env bash
# On the GPU box, from the repo root: `moedesk bench` on issue 41's family shapes, every expert in RAM, the first
# layers of each, in the issue's formats (q4_k for GLM-4.5-Air and DeepSeek-V3, mxfp4 for gpt-oss-120b), plus the
# 16-bit form as a reference point. gpt-oss's MXFP4 experts in RAM take the packed CPU kernel (kernels/cpu_quant.c,
# biases and clamped SwiGLU in the call; issue 41's target for its decode is 85% of the RAM-bandwidth bound), those
# on the GPU (copied at prefill) the packed Triton kernel, kernels/gpu_quant.py; with experts resident too:
# tests/perf/gpt_oss_gpu.sh.
# Usage: bash tests/perf/families_bench.sh [glm|deepseek|gpt-oss|qwen35 ...]   (writes $OUT/<shape>_<format>.json)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
which=${*:-glm deepseek gpt-oss qwen35}
run() { name=$1; shift; python3 -m moedesk bench "$@" --json > "$OUT/$name.json" 2>>"$OUT/families.log" || echo "$name failed"; }
for family in $which; do
  case $family in
    glm) for f in q4_k dense; do
           run "glm-4.5-air_$f" --shape glm-4.5-air --layers 12 --gpu-budget 0 --prefill 512 --decode-tokens 64 --expert-format "$f"
         done ;;
    deepseek) for f in q4_k dense; do
           run "deepseek-v3_$f" --shape deepseek-v3 --layers 8 --gpu-budget 0 --prefill 512 --decode-tokens 32 --expert-format "$f"
         done ;;
    qwen35) for f in q4_k dense; do
           run "qwen3.5-35b-a3b_$f" --shape qwen3.5-35b-a3b --layers 12 --gpu-budget 0 --prefill 512 --decode-tokens 64 \
               --expert-format "$f"
         done ;;
    gpt-oss) run "gpt-oss-120b_mxfp4" --shape gpt-oss-120b --layers 8 --gpu-budget 0 --prefill 512 --decode-tokens 16 \
               --batch 4 --expert-format mxfp4 ;;
  esac
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    try:
        d = json.load(open(f))
    except (OSError, ValueError):
        continue
    for r in d.get("results", []):
        print(f"{os.path.basename(f)[:-5]:28} {r['mode']:15} batch {r['batch']:3} {r['tok_s']:9.1f} tok/s"
              f"  bound {r.get('bound_tok_s')}")
PY
