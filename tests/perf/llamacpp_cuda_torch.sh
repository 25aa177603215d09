#!/usr/bin/env bash
# On the GPU box, after `bash tests/perf/llamacpp_engine_gpu.sh build` on the same machine (or with LLAMA_SITE set,
# as for its `compare`): does llama.cpp's CUDA build load beside torch on the product's own path, with no LD_PRELOAD?
# moedesk's import puts the system libstdc++ in the global symbol scope before torch's (moedesk/libstdcxx.py); session
# 36's probe crashed without it (case E) and ran with LD_PRELOAD of that library. Each case in its own process,
# 60 s at most:
#   P  import moedesk, then torch with CUDA initialised, then llama-cpp-python's Llama(n_gpu_layers=99): generates
#   L  moedesk's Engine.load(engine="llama.cpp", device="auto"), one layer's experts pinned to RAM: generates
#   X  P without `import moedesk` (the control: expected to crash as session 36's case B did)
# Then the llama.cpp engine's GPU tests (the pinned-layer read-back aborted in session 36) and the preload's own tests.
# If P or L fails: which objects llama.cpp's libraries bound C++ symbols to, other than the C and C++ runtimes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; B=/tmp/llb; W=/tmp/cudatorch; mkdir -p "$W"
unset LD_PRELOAD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if [ -n "${LLAMA_SITE:-}" ]; then export PYTHONPATH=$LLAMA_SITE:$PYTHONPATH; else
  . tests/perf/llamacpp_libs.sh && install_llamacpp_libs "$B"; fi
python3 -c "from tests.load.test_packed_experts import write_f32_moe; write_f32_moe('$W/f32.gguf', 'llama', L=3)" \
  > "$W/write.log" 2>&1 || { echo "the tiny GGUF was not written:"; tail -n 15 "$W/write.log"; exit 1; }
G=$W/f32.gguf
LLAMA="import llama_cpp; m = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); print(repr(m('the', max_tokens=4)['choices'][0]['text']))"
declare -A CASE=(
  [P]="import moedesk; import torch; torch.zeros(1, device='cuda'); $LLAMA"
  [L]="from moedesk.engine.requests import Request, SamplingParams; from moedesk.engine.runtime import Engine
e = Engine.load('$G', engine='llama.cpp', device='auto', context_length=64, cpu_moe=1)
r = e.complete([Request(e.tokenizer.encode('the quick'), SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))])[0]
print(e.device, sorted(e.overridden), r.token_ids)"
  [X]="import torch; torch.zeros(1, device='cuda'); $LLAMA"
)
failed=""
for c in P L X; do
  timeout 60 python3 -c "${CASE[$c]}" > "$W/$c.log" 2>&1; rc=$?
  echo "case $c: exit $rc" | tee -a "$W/exits.txt"; grep -v "^ *File\|^Extension\|^Current thread\|^$" "$W/$c.log" | tail -n 3 | cut -c1-300
  [ "$c" != X ] && ((rc != 0)) && failed="$failed $c"
done
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/llamacpp/test_overrides.py \
  tests/llamacpp/test_expert_counts.py tests/llamacpp/test_libstdcxx.py > "$W/pytest.txt" 2>&1
echo "pytest (exit $?):"; tail -n 6 "$W/pytest.txt"
# ld.so's bindings: llama.cpp's C++ symbols (_Z...) resolved outside the C/C++ runtimes and ggml itself, in the
# crashing control X and in P beside it (what the preload moved), and in L where it failed
foreign() {
  LD_DEBUG=bindings LD_DEBUG_OUTPUT=$W/bind timeout 60 python3 -c "${CASE[$1]}" > /dev/null 2>&1
  cat "$W"/bind.* 2>/dev/null | grep -E "binding file [^ ]*lib(ggml|llama)[^ ]* .* to " | grep "symbol \`_Z" \
    | grep -vE " to [^ ]*(libstdc\+\+|libgcc_s|libc\.so|libm\.so|libggml|libllama)" \
    | sed -E 's/.*binding file ([^ ]*) \[[0-9]+\] to ([^ ]*) \[[0-9]+\].*symbol `([^'"'"']*).*/\1 -> \2 \3/' \
    | sort | uniq -c | sort -rn > "$W/foreign_bindings_$1.txt"
  rm -f "$W"/bind.*
  echo "case $1: $(wc -l < "$W/foreign_bindings_$1.txt") C++ symbols of llama.cpp's bound outside the runtimes, by object:"
  awk '{print $2, $4}' "$W/foreign_bindings_$1.txt" | sort | uniq -c | sort -rn | head -n 8
}
for c in X P ${failed/P/}; do foreign "$c"; done
tar czf "$OUT/llamacpp_cuda_torch.tgz" -C "$W" --exclude='*.gguf' .
