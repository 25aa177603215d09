#!/usr/bin/env bash
# On the GPU box, from the repo root: issue 16's speculative-decoding and beam-search targets, measured with
# `moedesk bench --speculative` / `--beams` (every expert in RAM), full reports under $OUT, a short table last.
#
#   bash tests/perf/spec_bench.sh                  # both shapes, then the table
#   bash tests/perf/spec_bench.sh mixtral          # one phase (each fits one 10-minute device call)
#   bash tests/perf/spec_bench.sh qwen3
#   bash tests/perf/spec_bench.sh demo             # the demo model with DRAFT=<head folder> PROMPTS=<jsonl>
#   bash tests/perf/spec_bench.sh table DIR...     # the table of reports already written (default: $OUT)
#
# TOKENS (new tokens per sequence, default 32), ACCEPT (default 0.5,0.7,0.8,0.9) and BATCHES (default 1,4,16,32)
# change the runs' size; the short check of auto on the Qwen3 shape (about 2 minutes):
#   BATCHES=1,16 ACCEPT=0.5,0.8 bash tests/perf/spec_bench.sh qwen3
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
TOKENS=${TOKENS:-32}
ACCEPT=${ACCEPT:-0.5,0.7,0.8,0.9}
BATCHES=${BATCHES:-1,4,16,32}
phases=("$@"); [ ${#phases[@]} -eq 0 ] && phases=(mixtral qwen3)

bench() {  # name, bench arguments: the JSON report to $OUT/name.json, the human table to $OUT/name.txt
  name=$1; shift
  echo "== $name: moedesk bench $*"
  start=$(date +%s)
  if python3 -m moedesk bench "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.log"; then
    echo "   done in $(( $(date +%s) - start ))s"
  else
    echo "   $name failed; the end of $OUT/$name.log:"; tail -n 15 "$OUT/$name.log"
  fi
}

table_dirs=()
for phase in "${phases[@]}"; do
  case $phase in
    mixtral)
      nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader > "$OUT/gpu.txt" 2>&1
      bench mixtral --shape mixtral-8x7b --layers 8 --gpu-budget 0 --speculative --batches "$BATCHES" \
        --acceptance "$ACCEPT" --draft-length 4 --decode-tokens "$TOKENS" --beams 8 ;;
    qwen3)
      nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader > "$OUT/gpu.txt" 2>&1
      bench qwen3 --shape qwen3-30b-a3b --layers 12 --gpu-budget 0 --speculative --batches "$BATCHES" \
        --acceptance "$ACCEPT" --draft-length 4 --decode-tokens "$TOKENS" ;;
    demo)
      if [ -z "${DRAFT:-}" ] || [ -z "${PROMPTS:-}" ]; then echo "demo needs DRAFT=<head folder> PROMPTS=<file>"; continue; fi
      bench demo --model demo --draft "$DRAFT" --prompts "$PROMPTS" --gpu-budget 0 --batches 1,4,16 \
        --draft-length 4 --draft-width 4 --decode-tokens "${DEMO_TOKENS:-128}" ;;
    table) ;;
    *) [ -d "$phase" ] && table_dirs+=("$phase") || echo "unknown phase $phase" ;;
  esac
done
[ ${#table_dirs[@]} -eq 0 ] && table_dirs=("$OUT")

python3 - "${table_dirs[@]}" <<'PY'
import glob, json, os, sys

reports = {}
for folder in sys.argv[1:]:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            reports[os.path.basename(path)[:-5]] = json.load(open(path))
        except (OSError, ValueError):
            pass
if not reports:
    sys.exit("no reports found")

from moedesk.bench.synthetic import format_beam
from moedesk.bench.speculative import format_draft, format_speculative

for name, r in reports.items():
    if "speculative" in r or "beam" in r:
        text = "\n\n".join(f(r) for key, f in (("speculative", format_speculative), ("beam", format_beam)) if key in r)
    elif "throughput" in r:
        text = format_draft(r)
    else:
        continue
    out = os.path.join(sys.argv[1], name + ".txt")
    try:
        open(out, "w").write(text + "\n")
    except OSError:
        pass
    print(f"\n--- {name}\n{text}")

rows = []
def check(what, value, ok, fmt="{:.2f}"):
    rows.append((what, "-" if value is None else fmt.format(value), "-" if ok is None else ("yes" if ok else "NO")))

for name, r in reports.items():
    s = r.get("speculative")
    if s:
        g = s["gamma"]
        label = f"{r['shape']} x{r['layers']}"
        by_b = {p["batch"]: p for p in s["per_batch"]}
        if r["shape"] == "mixtral-8x7b" and 16 in by_b:
            hit = [x for x in s["runs"] if x["batch"] == 16 and x["mode"] == "greedy" and x["acceptance"] == 0.8]
            if hit and g == 4:
                x = hit[0]
                acc = (f"α measured {x['measured_acceptance']}, uncorrupted drafts accepted {x.get('agreement')}"
                       + (", α out of reach" if x.get("acceptance_capped") else ""))
                check(f"{label}: B=16 α=0.8 γ=4 speedup, whole run, >= 2.0 ({acc})", x["speedup"], x["speedup"] >= 2.0)
                full = x.get("full_batch_speedup")
                check(f"{label}: B=16 α=0.8 γ=4 speedup, full batch ({x.get('full_batch_rounds')} of "
                      f"{x['rounds']} rounds), >= 2.0", full, None if full is None else full >= 2.0)
            if g >= 4:
                eff = by_b[16]["T_ms"]["1"] / by_b[16]["T_ms"]["5"]
                check(f"{label}: T(16,1)/T(16,5) >= 0.7", eff, eff >= 0.7)
        low = min(s["per_batch"], key=lambda p: p["auto_min_speedup"])
        figure = "full batch" if s.get("auto_judged_on") == "full_batch" else "whole run"
        check(f"{label}: auto >= 0.98x plain ({figure}), every B {s['batches']} (lowest at B={low['batch']})",
              low["auto_min_speedup"], s["auto_never_loses"])
        whole = [p["auto_min_speedup_whole_run"] for p in s["per_batch"] if p.get("auto_min_speedup_whole_run")]
        if whole:
            check(f"{label}: auto, lowest whole-run speedup over every B", min(whole), None)
        if s.get("fit"):
            check(f"{label}: MoESD fit error rms / max", None, None)
            rows[-1] = (rows[-1][0], f"{100 * s['fit']['rms_relative_error']:.1f}% / "
                                     f"{100 * s['fit']['max_relative_error']:.1f}%", "")
        if "prediction_mean_abs_error" in s:
            check(f"{label}: model vs measured speedup, mean |error|", 100 * s["prediction_mean_abs_error"], None,
                  "{:.1f}%")
    b = r.get("beam")
    if b:
        check(f"{r['shape']} x{r['layers']}: beam W={b['beams']} step / batched {b['beams']} <= 1.2 "
              f"({b['beam_step_ms']:.1f} vs {b['batched_step_ms']:.1f} ms)", b["ratio"], b["ratio"] <= 1.2)
    if "throughput" in r:
        chain = r["acceptance"][0]
        check(f"{r['model']}: tokens per verify step, chain of {chain['draft_length']} >= 2.5",
              chain["tokens_per_step"], (chain["tokens_per_step"] or 0) >= 2.5)
        if len(r["acceptance"]) > 1:
            tree = r["acceptance"][1]
            check(f"{r['model']}: tree of {tree['verified_nodes']} nodes above the chain", tree["tokens_per_step"],
                  (tree["tokens_per_step"] or 0) > (chain["tokens_per_step"] or 0))
        for t in r["throughput"]:
            check(f"{r['model']}: B={t['batch']} speculative / plain tok/s", t["speedup"], None)

gpu = glob.glob(os.path.join(sys.argv[1], "gpu.txt"))
print("\n=== issue 16 targets" + (f" ({open(gpu[0]).read().strip()})" if gpu else ""))
width = max(len(w) for w, _, _ in rows) if rows else 10
for what, value, ok in rows:
    print(f"{what:<{width}}  {value:>14}  {ok}")
PY
