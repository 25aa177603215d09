#!/usr/bin/env bash
# Issue 45.1's target on the two-GPU box (kind nvidia-h200-x2): the whole Mixtral-8x7B shape (32 layers) with Q4_K
# experts, two GPUs with a 16 GiB budget each against one GPU with 16 GiB. Both budgets are whole GPUs' (weights,
# the KV cache of the context the runs build, then experts; one figure also sets aside a prefill workspace and slack,
# which the per-device plan does not: a little more room for the two GPUs' experts).
# Four commands, each within one device call (a build of the shape takes minutes):
#   bash tests/perf/multigpu_bench.sh one        (one GPU, 16 GiB)
#   bash tests/perf/multigpu_bench.sh two        (cuda:0 and cuda:1, 16 GiB each: CUDA graphs per device)
#   bash tests/perf/multigpu_bench.sh two-eager  (the same with MOEDESK_NO_CUDA_GRAPHS=1: decode launched eagerly)
#   bash tests/perf/multigpu_bench.sh llama      (llama-bench on the same two GPUs, -ts 1/1, at every -ncmoe from
#                                                 the least our budget split fits to SWEEP more; -v logs each GPU's
#                                                 buffers, so the report marks which fit 16 GiB each)
#   bash tests/perf/multigpu_bench.sh report     (decode and prefill, two GPUs over one; target: decode >= 1.3x;
#                                                 then two GPUs' graphs over eager where two_gpus_eager.json is there;
#                                                 then two GPUs over llama.cpp's best fitting -ncmoe; target >= 1.5x)
# The figures land in $OUT (default /tmp/multigpu) as one_gpu.json, two_gpus.json and two_gpus_eager.json.
# Prediction for graphs on over off (two GPUs): decode >= 1.3x at batch 16 and more at smaller batches (the step
# outside the experts drops from tens of ms of launches to about a ms, plus one hidden-state copy per cut); prefill
# within noise (it is eager either way).
set -euo pipefail
OUT=${OUT:-/tmp/multigpu}; mkdir -p "$OUT"
# ROUTING=no-locality (or conversation): the decode runs replay spread routing (bench/routing.py); the random
# weights' own routers favour a few experts, which one GPU's share already holds.
ARGS=(--shape mixtral-8x7b --expert-format q4_k --prefill 512 --batch 16 --decode-tokens 64 --routing "${ROUTING:-model}"
      --json)
case "${1:-}" in
one) python -m moedesk.app.cli bench "${ARGS[@]}" --device cuda:0 --gpu-budget 16 > "$OUT/one_gpu.json" ;;
two) python -m moedesk.app.cli bench "${ARGS[@]}" --device cuda --gpu-budget 16,16 > "$OUT/two_gpus.json" ;;
two-eager) MOEDESK_NO_CUDA_GRAPHS=1 python -m moedesk.app.cli bench "${ARGS[@]}" --device cuda --gpu-budget 16,16 \
  > "$OUT/two_gpus_eager.json" ;;
llama)  # needs llama-bench in $LLB (tests/perf/llamacpp_engine_gpu.sh build)
  LLB=${LLB:-/tmp/llb}; W=/tmp/multigpu_gguf; mkdir -p "$W"; threads=${THREADS:-$(python3 -c \
    "import psutil; print(psutil.cpu_count(logical=False))")}
  [ -f "$W/mixtral.gguf" ] || python3 tests/perf/make_mixtral_q4k_gguf.py "$W/mixtral.gguf" 32 > "$W/write.log" 2>&1 \
    || { tail -n 5 "$W/write.log"; exit 1; }
  least=$(python3 -m moedesk.bench.budget --ncmoe mixtral-8x7b 0 32 $((512 + 64 + 1)) q4_k)
  for n in $(seq "$least" $((least + ${SWEEP:-3} > 32 ? 32 : least + ${SWEEP:-3}))); do
    timeout 200 "$LLB/bin/llama-bench" -m "$W/mixtral.gguf" -ngl 99 -ncmoe "$n" -ts 1/1 -fa 1 -t "$threads" -p 512 \
      -n 64 -r 2 -o json -v > "$OUT/llama_ncmoe$n.json" 2> "$OUT/llama_ncmoe$n.log"
    echo "-ncmoe $n: exit $?"
  done ;;
report)
  python - "$OUT" <<'EOF'
import glob, json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
one, two = (json.loads((out / name).read_text()) for name in ("one_gpu.json", "two_gpus.json"))
for report in (one, two):
    print(f"{report['gpu_budget_gib']} GiB: {report['experts_on_gpu']} experts on the GPUs",
          *(f"GPU {d['device']}: MoE layers {d['moe_layers']}, {d['experts_on_gpu']} experts"
            for d in report.get("devices", ())), sep="\n  ")
for a, b in zip(one["results"], two["results"]):
    ratio = b["tok_s"] / a["tok_s"]
    print(f"{a['mode']:>15} batch {a['batch']:>2} depth {a['depth']:>5}: one {a['tok_s']:8.2f} tok/s, "
          f"two {b['tok_s']:8.2f} tok/s, x{ratio:.2f}")
if (out / "two_gpus_eager.json").exists():  # CUDA graphs per device against eager decode, both on two GPUs
    eager = json.loads((out / "two_gpus_eager.json").read_text())
    for a, b in zip(eager["results"], two["results"]):
        print(f"{a['mode']:>15} batch {a['batch']:>2} depth {a['depth']:>5}: two eager {a['tok_s']:8.2f} tok/s, "
              f"graphs {b['tok_s']:8.2f} tok/s, x{b['tok_s'] / a['tok_s']:.2f}")
# llama.cpp on the same two GPUs: a -ncmoe counts where each GPU's model, KV and compute buffers fit 16 GiB
best = None
for path in sorted(glob.glob(f"{out}/llama_ncmoe*.json")):
    n = int(re.search(r"ncmoe(\d+)", path).group(1))
    mib = {}
    for line in open(path[:-4] + "log", errors="replace"):
        if m := re.search(r"(CUDA\d) (?:model|KV|compute) buffer size\s*=\s*([\d.]+) MiB", line):
            mib[m[1]] = mib.get(m[1], 0) + float(m[2])
    try:
        rows = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.load(open(path))}
    except ValueError:
        print(f"llama.cpp -ncmoe {n}: no result"); continue
    fits = bool(mib) and max(mib.values()) <= 16 * 1024
    print(f"llama.cpp -ncmoe {n:>2}: decode {rows.get('decode', 0):7.2f}, prefill {rows.get('prefill', 0):8.1f} tok/s; "
          + ", ".join(f"{d} {v / 1024:.2f} GiB" for d, v in sorted(mib.items())) + ("" if fits else "  (over 16 GiB)"))
    if fits and (best is None or rows.get("decode", 0) > best[1].get("decode", 0)):
        best = n, rows
if best:
    ours = {r["mode"]: r["tok_s"] for r in two["results"] if r["batch"] == 1}
    for mode in ("decode", "prefill"):
        if mode in ours and best[1].get(mode):
            print(f"two GPUs over llama.cpp -ncmoe {best[0]} -ts 1/1, {mode}: x{ours[mode] / best[1][mode]:.2f}"
                  + ("  (target 1.5x)" if mode == "decode" else ""))
EOF
  ;;
*) echo "usage: $0 one|two|two-eager|llama|report" >&2; exit 2 ;;
esac
