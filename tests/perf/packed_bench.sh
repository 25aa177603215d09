#!/usr/bin/env bash
# On the GPU box, from the repo root: `moedesk bench` with 16-bit and packed experts, every expert in RAM,
# one machine, one command, so the formats compare with each other (and with llama.cpp's figures for the
# same shapes and formats, measured by tests/perf/compare_llamacpp.sh).
# Usage: bash tests/perf/packed_bench.sh [mixtral|qwen3|both] [formats...]   (needs $OUT; wheels in .whl)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
which=${1:-both}; shift || true
formats=${*:-dense q4_0 q4_k q8_0}
run() { name=$1; shift; python3 -m moedesk bench "$@" --json > "$OUT/$name.json" 2>>"$OUT/bench.log" || echo "$name failed"; }
for f in $formats; do
  if [ "$which" != qwen3 ]; then
    run "mixtral_$f" --shape mixtral-8x7b --layers 8 --gpu-budget 0 --prefill 512 --decode-tokens 32 --expert-format "$f"
  fi
  if [ "$which" != mixtral ]; then
    run "qwen3_$f" --shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --prefill 512 --decode-tokens 64 --expert-format "$f"
  fi
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    for r in d["results"]:
        rows[(d["shape"], d["experts"], r["mode"], r["batch"])] = (r["tok_s"], r["bound_tok_s"], r["pct_of_bound"])
print(f"{'shape':<15}{'experts':<10}{'mode':<16}{'batch':>5}{'tok/s':>9}{'bound':>9}{'%':>5}{'x 16-bit':>9}")
for (shape, experts, mode, batch), (tok, bound, pct) in sorted(rows.items()):
    base = next((v[0] for k, v in rows.items() if k[0] == shape and k[2:] == (mode, batch)
                 and k[1] in ("bfloat16", "float32")), None)
    print(f"{shape:<15}{experts:<10}{mode:<16}{batch:>5}{tok:>9.1f}{(bound or 0):>9.1f}{(pct or 0):>5.0f}"
          f"{(tok / base if base else 0):>9.2f}")
PY
