#!/bin/bash
# The demo's decode and prefill (`moedesk batch`: one ~420-token prompt, 32 tokens) and the chat app's reply
# (chat_reply_speed.py), with nothing else running and beside one busy process (a user's other program), under each
# setting given (an environment assignment; default: the decode thread following the machine, and not).
# Runs here, on the CPU: `bash tests/perf/cpu_share_matrix.sh [SETTING ...]`; REPS runs each (default 2).
cd "$(dirname "$0")/../.."
REPS=${REPS:-2}
PY=${PY:-python3}
SETTINGS=("$@")
[ ${#SETTINGS[@]} = 0 ] && SETTINGS=(MOEDESK_FOLLOW_CPU=0 MOEDESK_FOLLOW_CPU=1)
work=$(mktemp -d)
$PY -c "import json; print(json.dumps({'id': 'a', 'prompt': 'Tell me about the sea. ' * 70}))" > "$work/in.jsonl"
run_batch() {  # engine setting
  rm -f "$work/out.jsonl"
  env "$2" $PY -m moedesk batch "$work/in.jsonl" -o "$work/out.jsonl" --engine "$1" --temperature 0 \
    --max-new-tokens 32 --ignore-eos >/dev/null 2>&1
  $PY -c "import json; r=json.load(open('$work/out.jsonl')); s=r['stats']; \
print(s['decode_tok_s'], round(r['usage']['prompt_tokens'] / s['ttft_s'], 1))"
}
for busy in 0 1; do
  pid=""
  if [ "$busy" = 1 ]; then $PY -c 'while True: pass' & pid=$!; fi
  for engine in native llama.cpp; do
    for setting in "${SETTINGS[@]}"; do
      res=""
      for _ in $(seq "$REPS"); do res="$res | $(run_batch "$engine" "$setting")"; done
      printf 'busy=%s %-9s %-26s decode, prefill tok/s %s\n' "$busy" "$engine" "$setting" "$res"
    done
  done
  for setting in "${SETTINGS[@]}"; do
    env "$setting" PROBE="busy=$busy chat $setting" $PY tests/perf/chat_reply_speed.py 2>&1 | tail -1
  done
  [ -n "$pid" ] && kill "$pid"
done
rm -rf "$work"
