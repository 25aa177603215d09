#!/usr/bin/env bash
# On the GPU box (as root), from the repo root: issue 42 item 4's target. A whole Mixtral-8x7B-shaped GGUF with
# Q4_K experts (~26 GB, tests/perf/make_mixtral_q4k_gguf.py) loads and decodes in a cgroup whose memory.max is
# 1.15x the file's size (swap off for it), through the user's path: `moedesk batch --model FILE` on the GPU.
# Needs ~27 GB of disk for the file (kept in $DIR between runs) and a writable cgroup file system.
# Usage: bash tests/perf/load_under_cgroup.sh [FACTOR]   (FACTOR: 1.15 by default; writes $OUT/load_under_cgroup.log)
# SPLIT=N: the same file split in N parts as llama.cpp's gguf-split lays them out (tests/gguf_split.py, written once
# into $DIR/split, another ~26 GB of disk), loaded from its first part, the limit FACTOR x the parts' sizes.
#
# Without a writable cgroup (v2 or v1) it asks systemd-run for a scope with MemoryMax and MemorySwapMax=0; without
# either the script stops and says so, rather than fall back to prlimit: RLIMIT_AS
# bounds address space, not memory, and both the GGUF reader's map of the whole file and CUDA's reservations are
# address space that is never resident, so a prlimit at 1.15x fails for reasons that say nothing about the load.
set -uo pipefail
OUT=${OUT:-/tmp/out}; DIR=${DIR:-/tmp/moedesk-cgroup}; FACTOR=${1:-1.15}
mkdir -p "$OUT" "$DIR"
. tests/perf/gpu_env.sh  # the project's wheels the box lacks (gguf, platformdirs) ahead on PYTHONPATH
LOG=$OUT/load_under_cgroup.log
MODEL=$DIR/mixtral-8x7b-q4k.gguf
# The same file compare_llamacpp.sh depth-build writes: taken from there if it is on the disk already (two copies
# of 26 GB would leave the box's 64 GB little room).
[ -f "$MODEL" ] || [ ! -f /tmp/compare/mix_q4k_whole.gguf ] || MODEL=/tmp/compare/mix_q4k_whole.gguf
if [ ! -f "$MODEL" ]; then
  python3 tests/perf/make_mixtral_q4k_gguf.py "$MODEL.partial" 32 >>"$LOG" 2>&1 && mv "$MODEL.partial" "$MODEL" \
    || { echo "writing $MODEL failed (see $LOG)"; exit 1; }
fi
if [ "${SPLIT:-1}" -gt 1 ]; then
  FIRST=$DIR/split/mixtral-8x7b-q4k-00001-of-$(printf %05d "$SPLIT").gguf
  [ -f "$FIRST" ] || python3 -m tests.gguf_split "$MODEL" "$DIR/split/mixtral-8x7b-q4k.gguf" "$SPLIT" >>"$LOG" 2>&1 \
    || { echo "splitting $MODEL failed (see $LOG)"; exit 1; }
  MODEL=$FIRST
fi
SIZE=$(python3 -c "import sys; sys.path.insert(0, '.'); from pathlib import Path; from tests.gguf_split import parts_size
print(parts_size(Path(sys.argv[1])))" "$MODEL")
# Without a size the limit would be empty and the group unlimited or broken: stop rather than measure nothing.
[ -n "$SIZE" ] || { echo "the size of $MODEL could not be read (see above)" | tee -a "$LOG"; exit 1; }
LIMIT=$(python3 -c "print(int($SIZE * $FACTOR))")
echo "file $SIZE bytes, memory.max $LIMIT ($FACTOR x)" | tee -a "$LOG"
echo '{"id": "a", "prompt": "the quick brown fox"}' > "$DIR/in.jsonl"
sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null  # the file read from disk, as a user's first load

GROUP=""
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # v2: memory must be delegated to the children of the root
  echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
  GROUP=/sys/fs/cgroup/moedesk-load; mkdir -p "$GROUP" 2>/dev/null
  { echo "$LIMIT" > "$GROUP/memory.max" && echo 0 > "$GROUP/memory.swap.max"; } 2>/dev/null || GROUP=""
  PEAK_FILE=memory.peak; EVENTS="$GROUP/memory.events"
elif [ -d /sys/fs/cgroup/memory ]; then  # v1
  GROUP=/sys/fs/cgroup/memory/moedesk-load; mkdir -p "$GROUP" 2>/dev/null
  echo "$LIMIT" > "$GROUP/memory.limit_in_bytes" 2>/dev/null || GROUP=""
  echo "$LIMIT" > "$GROUP/memory.memsw.limit_in_bytes" 2>/dev/null  # no swap either, where swap is accounted
  PEAK_FILE=memory.max_usage_in_bytes; EVENTS="$GROUP/memory.oom_control"
fi
TIMER=(); [ -x /usr/bin/time ] && TIMER=(/usr/bin/time -v)  # its maximum resident size beside the group's peak
LOAD=(python3 -m moedesk batch "$DIR/in.jsonl" -o "$DIR/out.jsonl" --model "$MODEL" --device cuda --max-new-tokens 32)
if [ -z "$GROUP" ] && command -v systemd-run >/dev/null && systemd-run --scope --quiet true 2>/dev/null; then
  # No cgroup folder of our own to write, but systemd manages the cgroups: a transient scope with the same limits.
  # The scope's cgroup goes with it: its peak and events are copied out before the scope ends.
  systemd-run --scope --quiet --unit "moedesk-load-$$" -p MemoryMax="$LIMIT" -p MemorySwapMax=0 bash -c '
    g=/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup); "${@:2}"; rc=$?
    cat "$g/memory.peak" > "$1/scope.peak"; cat "$g/memory.events" > "$1/scope.events"; exit $rc' \
    _ "$DIR" "${TIMER[@]}" "${LOAD[@]}" >>"$LOG" 2>&1
  RC=$?
  GROUP=$DIR; PEAK_FILE=scope.peak; EVENTS="$DIR/scope.events"
elif [ -z "$GROUP" ]; then
  echo "no writable cgroup and no systemd-run on this machine: the target needs one (see the comment at the top;" \
    "prlimit proves nothing)" | tee -a "$LOG"
  exit 2
else
  # The shell joins the group, then runs the load: everything the process does is charged to it, the page cache of
  # the file's reads too (reclaimable: the kernel drops it before it would kill the process).
  ( echo $BASHPID > "$GROUP/cgroup.procs" && "${TIMER[@]}" "${LOAD[@]}" ) >>"$LOG" 2>&1
  RC=$?
fi
echo "exit $RC; group's peak $(cat "$GROUP/$PEAK_FILE" 2>/dev/null) bytes ($(python3 -c "
import sys; print(f'{int(sys.argv[1]) / $SIZE:.3f}x the file')" "$(cat "$GROUP/$PEAK_FILE" 2>/dev/null || echo 0)"))" | tee -a "$LOG"
grep -E "Maximum resident|Elapsed" "$LOG" | tail -2
cat "$EVENTS" 2>/dev/null | tee -a "$LOG"
head -c 400 "$DIR/out.jsonl" 2>/dev/null; echo
[ "$GROUP" = "$DIR" ] || rmdir "$GROUP" 2>/dev/null
exit $RC
