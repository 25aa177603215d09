#!/usr/bin/env bash
# On the GPU box, from the repo root (~5 min): one `moedesk bench` case under several settings, one after another on
# one machine, and for each its tok/s and where a step's MoE time went: the CPU's calls, the wait for the routing,
# the host's queueing of the GPU's share (`queue_ms`), the layers in all. The default case is whole_targets.sh's
# whole Mixtral-8x7B Q4_K at 16 GiB routed as a conversation, whose 16 sequences queued 64 ms of a 146 ms step
# (docs/measurements.md, "Session 50").
#   bash tests/perf/queue_probe.sh
#   VARIANTS="default MOEDESK_CPU_THREADS=15" CASE="--shape ..." bash tests/perf/queue_probe.sh
# VARIANTS: "default" or NAME=VALUE (several joined with commas) per run. Leaves in $OUT: queue_probe.txt (the
# table) and queue_probe.tar.gz (each run's report and log).
set -uo pipefail
. tests/perf/gpu_env.sh
CASE=${CASE:---shape mixtral-8x7b --expert-format q4_k --gpu-budget 16 --prefill 512 --routing conversation}
VARIANTS=${VARIANTS:-default MOEDESK_CPU_THREADS=15 MOEDESK_NO_PREFILL_RATES=1}
W=/tmp/queue_probe; rm -rf "$W"; mkdir -p "$W"
n=0
for v in $VARIANTS; do
  n=$((n + 1)); settings=(); [ "$v" = default ] || IFS=, read -ra settings <<< "$v"
  env "${settings[@]}" timeout "${RUN_S:-240}" python3 -m moedesk bench $CASE --json > "$W/$n.json" 2> "$W/$n.log" \
    || { echo "$v: bench failed"; tail -n 3 "$W/$n.log"; }
  echo "$v" > "$W/$n.variant"
done
python3 - "$W" <<'PY' | tee "$OUT/queue_probe.txt"
import glob, json, os, sys
print(f"{'variant':<34}{'mode':<15}{'tok/s':>8}  ms a step: {'CPU calls':>9}{'routing':>9}{'queueing':>9}{'layers':>8}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")), key=lambda p: int(os.path.basename(p)[:-5])):
    variant = open(path[:-5] + ".variant").read().strip()
    try:
        report = json.load(open(path))
    except ValueError:
        print(f"{variant:<34}no report"); continue
    for r in report["results"]:
        e = r.get("experts") or {}
        steps = r["rounds"] if r["mode"] == "prefill" else r["tokens"]  # a prefill's step: the whole prompt
        per = lambda key: e.get(key, 0.0) / max(steps, 1)
        print(f"{variant:<34}{r['mode']:<15}{r['tok_s']:>8.1f}  {'':>11}{per('cpu_expert_ms'):>9.1f}"
              f"{per('gpu_wait_ms'):>9.1f}{per('queue_ms'):>9.1f}{per('moe_ms'):>8.1f}")
PY
tar czf "$OUT/queue_probe.tar.gz" -C "$W" .
