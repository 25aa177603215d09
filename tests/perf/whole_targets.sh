#!/usr/bin/env bash
# On the GPU box, from the repo root, in one device command: issue 42's whole-model targets against llama.cpp's best
# -ncmoe for the same GPU budget. Mixtral-8x7B (32 layers) at 16 GiB and Qwen3-30B-A3B (48 layers) at 8 GiB, Q4_K
# experts, and gpt-oss-20b (24 layers, MXFP4, all of it on a 16 GB GPU) at 16 GiB; random weights, both sides fed
# random tokens.
#   llama.cpp: the GGUF written quantised from the start (make_mixtral_q4k_gguf.py, make_family_gguf.py), then
#     llama-bench -ngl 99 -fa 1 -t 16 -p 512 -n 64 at every -ncmoe from the least that fits the budget (our split of
#     it, in whole layers: python3 -m moedesk.bench.budget --ncmoe) to SWEEP layers more, and with every expert in RAM;
#     llama-batched-bench's 16 sequences at the best of them.
#   moedesk: moedesk bench --gpu-budget G --expert-format F --prefill 512 (decode, prefill 512, 16 sequences), on the
#     shape built in memory and on llama.cpp's file (bench --gguf; FILE_BENCH=0 skips it).
# Targets: Mixtral decode >= 2x llama.cpp's best, prefill 512 >= 4x, 16 sequences >= 3x; Qwen3 decode >= 1.5x;
# gpt-oss-20b, issue 41's decode >= 1.5x (its MoE targets, here with every expert on the GPU).
# Needs llama-bench and llama-batched-bench in $LLB (tests/perf/llamacpp_engine_gpu.sh build). Leaves in $OUT:
# whole_summary.txt (the sweep and the ratios) and whole_targets.tar.gz (every JSON and log).
# Usage: [LLB=/tmp/llb] [SWEEP=3] [ROUTING=model] bash tests/perf/whole_targets.sh [mixtral] [qwen3] [gpt-oss]
# (mixtral and qwen3 by default)
# ROUTING=no-locality (or conversation): our plain decode runs replay spread routing (bench/routing.py), where the
# random weights' own routers favour a few experts that the GPU then holds; llama-bench routes as its file does.
# OURS_FIRST=1: ours on the shape also runs first, before the GGUF is written and llama.cpp runs (a summary line
# beside the usual run): whether what runs before ours on the machine moves its figures (docs/measurements.md,
# "Session 59").
# VARIANT="NAME=VALUE ...": ours on the shape once more, after the usual run, under those environment variables (a
# summary line with its ratios against the same llama.cpp run), e.g. VARIANT=MOEDESK_NO_ZERO_COPY=1.
set -uo pipefail
. tests/perf/gpu_env.sh
LLB=${LLB:-/tmp/llb}; SWEEP=${SWEEP:-3}; W=/tmp/whole; mkdir -p "$W"
MODELS=${*:-mixtral qwen3}
[ -x "$LLB/bin/llama-bench" ] && [ -x "$LLB/bin/llama-batched-bench" ] \
  || { echo "no llama-bench/llama-batched-bench in $LLB: run tests/perf/llamacpp_engine_gpu.sh build first"; exit 1; }
clean() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }  # each side starts from a cold page cache

ours() {  # ours on the model's shape built in memory, routed as ROUTING says: ours NAME [NAME=VALUE...] (the loop's
  local name=$1; shift  # $m, $shape...; the assignments are the run's environment)
  env "$@" timeout 400 python3 -m moedesk bench --shape "$shape" --expert-format "$fmt" --gpu-budget "$gib" --prefill 512 \
    --routing "${ROUTING:-model}" --json > "$W/${m}_$name.json" 2> "$W/${m}_$name.log" || tail -n 5 "$W/${m}_$name.log"
}

for m in $MODELS; do
  case $m in
    mixtral) shape=mixtral-8x7b; layers=32; gib=16; fmt=q4_k
             write=(python3 tests/perf/make_mixtral_q4k_gguf.py "$W/$m.gguf" 32) ;;
    qwen3) shape=qwen3-30b-a3b; layers=48; gib=8; fmt=q4_k
           write=(python3 tests/perf/make_family_gguf.py qwen3-30b-a3b "$W/$m.gguf" 48) ;;
    gpt-oss) shape=gpt-oss-20b; layers=24; gib=16; fmt=mxfp4
             write=(python3 tests/perf/make_family_gguf.py gpt-oss-20b "$W/$m.gguf" 24) ;;
    *) echo "unknown model $m (mixtral, qwen3, gpt-oss)"; exit 2 ;;
  esac
  [ "${OURS_FIRST:-0}" = 0 ] || { clean; ours ours_first; }
  [ -f "$W/$m.gguf" ] || "${write[@]}" > "$W/${m}_write.log" 2>&1 || { tail -n 5 "$W/${m}_write.log"; continue; }
  least=$(python3 -m moedesk.bench.budget --ncmoe "$shape" 0 "$gib" $((512 + 64 + 1)) "$fmt")
  sweep=$(seq "$least" $((least + SWEEP > layers ? layers : least + SWEEP)); echo "$layers")
  echo "$m: llama-bench -ncmoe $(echo $sweep | tr ' ' ,) ($gib GiB fits $least and up)"
  clean
  for n in $(echo "$sweep" | sort -un); do
    timeout 300 "$LLB/bin/llama-bench" -m "$W/$m.gguf" -ngl 99 -ncmoe "$n" -fa 1 -t 16 -p 512 -n 64 -r 2 -o json \
      > "$W/${m}_llama_ncmoe$n.json" 2> "$W/${m}_llama_ncmoe$n.log"
  done
  best=$(python3 - "$W" "$m" <<'PY'
import glob, json, re, sys
w, m = sys.argv[1:]
decode = {}
for path in glob.glob(f"{w}/{m}_llama_ncmoe*.json"):
    try:
        decode[int(re.search(r"ncmoe(\d+)", path).group(1))] = next(r["avg_ts"] for r in json.load(open(path))
                                                                       if not r["n_prompt"])
    except (ValueError, StopIteration):
        pass
print(max(decode, key=decode.get) if decode else "")
PY
)
  [ -n "$best" ] && timeout 300 "$LLB/bin/llama-batched-bench" -m "$W/$m.gguf" -ngl 99 -ncmoe "$best" -fa 1 -t 16 \
    -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 -npl 16 2>&1 | grep -E '^\|' > "$W/${m}_llama_batched.txt"
  # Ours on the very file llama-bench ran (bench --gguf): the same weights route as llama.cpp's do, where the shape
  # built in memory routes as ROUTING says; like for like. FILE_BENCH=0 skips it.
  clean
  [ "${FILE_BENCH:-1}" = 0 ] || timeout 400 python3 -m moedesk bench --gguf "$W/$m.gguf" --gpu-budget "$gib" \
    --prefill 512 --json > "$W/${m}_file.json" 2> "$W/${m}_file.log" || tail -n 5 "$W/${m}_file.log"
  rm -f "$W/$m.gguf"  # the disk and the page cache back for our banks
  clean
  ours ours
  # shellcheck disable=SC2086  # the assignments split on spaces
  [ -z "${VARIANT:-}" ] || { clean; ours variant $VARIANT; }
done

VARIANT=${VARIANT:-} python3 - "$W" $MODELS <<'PY' | tee "$OUT/whole_summary.txt"
import glob, json, os, re, sys
w, models = sys.argv[1], sys.argv[2:]
goals = {"mixtral": {"decode": 2.0, "prefill": 4.0, "batched_decode": 3.0}, "qwen3": {"decode": 1.5},
         "gpt-oss": {"decode": 1.5}}
for m in models:
    sweep = {}
    for path in glob.glob(f"{w}/{m}_llama_ncmoe*.json"):
        try:
            rows = json.load(open(path))
        except ValueError:
            continue
        n = int(re.search(r"ncmoe(\d+)", path).group(1))
        sweep[n] = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    print(f"{m}: llama-bench by -ncmoe (decode / prefill 512)")
    for n in sorted(sweep):
        print(f"  -ncmoe {n:>2}: {sweep[n].get('decode', 0):7.1f} / {sweep[n].get('prefill', 0):8.1f}")
    try:
        report = json.load(open(f"{w}/{m}_ours.json"))
        ours = {r["mode"]: r for r in report["results"]}
    except (FileNotFoundError, ValueError):
        print("  moedesk: no result"); continue
    try:
        on_file = {r["mode"]: r for r in json.load(open(f"{w}/{m}_file.json"))["results"]}
    except (FileNotFoundError, ValueError, KeyError):
        on_file = {}
    print(f"  moedesk routed by {report.get('routing', 'model')}; {report.get('experts_on_gpu')} experts on the GPU")
    try:  # OURS_FIRST: the same bench before llama.cpp ran on the machine
        first = {r["mode"]: r["tok_s"] for r in json.load(open(f"{w}/{m}_ours_first.json"))["results"]}
        print("  moedesk before llama.cpp ran: " + ", ".join(f"{mode} {first[mode]:.1f}" for mode in
                                                             ("decode", "prefill", "batched_decode") if mode in first))
    except (FileNotFoundError, ValueError, KeyError):
        pass
    batched = None
    try:  # llama-batched-bench's S_TG t/s column on the 16-sequence row
        rows = [line for line in open(f"{w}/{m}_llama_batched.txt") if re.match(r"\|\s+128", line)]
        batched = float(rows[-1].split("|")[8]) if rows else None
    except FileNotFoundError:
        pass
    best = {k: max((s.get(k, 0) for s in sweep.values()), default=0) for k in ("decode", "prefill")}
    best["batched_decode"] = batched
    # "on file": ours on llama.cpp's file, its ratio the like-for-like one; "met" marks each ratio at its goal
    print(f"  {'case':<16}{'moedesk':>9}{'on file':>9}{'llama best':>12}{'ratio':>7}{'on file':>8}{'goal':>6}"
          f"{'% bound':>9}")
    for mode in ("decode", "prefill", "batched_decode"):
        r, ref, same = ours.get(mode), best.get(mode), on_file.get(mode, {}).get("tok_s")
        if not r:
            continue
        ratio, same_ratio = (r["tok_s"] / ref if ref else 0), (same / ref if ref and same else 0)
        goal = goals[m].get(mode)
        met = " ".join(f"met{which}" for which, x in (("", ratio), (" on file", same_ratio)) if goal and x >= goal)
        print(f"  {mode:<16}{r['tok_s']:>9.1f}{same or 0:>9.1f}{ref or 0:>12.1f}{ratio:>7.2f}{same_ratio:>8.2f}"
              f"{goal or 0:>6.1f}{r.get('pct_of_bound') or 0:>8.0f}%  {met}".rstrip())
    try:  # VARIANT: the same bench under other settings, after the usual one
        variant = {r["mode"]: r["tok_s"] for r in json.load(open(f"{w}/{m}_variant.json"))["results"]}
        print(f"  moedesk with {os.environ['VARIANT']}: " + ", ".join(
            f"{mode} {variant[mode]:.1f} ({variant[mode] / best[mode]:.2f}x)" for mode in
            ("decode", "prefill", "batched_decode") if mode in variant and best.get(mode)))
    except (FileNotFoundError, ValueError, KeyError):
        pass
PY
tar czf "$OUT/whole_targets.tar.gz" -C "$W" --exclude='*.gguf' .
