#!/usr/bin/env bash
# On the GPU box, after `bash tests/perf/llamacpp_engine_gpu.sh build` on the same machine: where does a model load
# through moedesk's llama.cpp engine segfault on llama.cpp's CUDA build (llama-bench on the same libraries runs)?
# Quantises a tiny F32 GGUF (Q, torch not imported), then loads it four ways, each in its own process, and says which
# crash:
#   A  llama-cpp-python's own Llama(n_gpu_layers=99), torch not imported
#   B  the same after torch has initialised CUDA (two CUDA runtimes in one process?)
#   C  moedesk's Engine.load(engine="llama.cpp", device="auto"), no expert pinned
#   D  the same with one layer's experts pinned to RAM (the tensor-buffer override)
#   E  A after `import torch` without CUDA; F  llama.cpp's CUDA first (one load), then torch's, then A again
# (M: which libggml/libllama files the process maps), each with the libraries copied and then linked; then a gdb
# backtrace of the first that crashes, and which CUDA libraries each side maps.
# Session 36 found the fix (the system libstdc++ preloaded); `import moedesk` now does it (moedesk/libstdcxx.py), so
# C and D go through it: tests/perf/llamacpp_cuda_torch.sh is the short check of that path.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; B=/tmp/llb; W=/tmp/probe; mkdir -p "$W"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
. tests/perf/llamacpp_libs.sh  # install_llamacpp_libs: the libraries copied (as when the loads crashed) or linked
install_llamacpp_libs "$B" link  # the tiny GGUF's writer (tests/load/test_packed_experts.py) imports llama_cpp
python3 -c "from tests.load.test_packed_experts import write_f32_moe; write_f32_moe('$W/f32.gguf', 'llama', L=3)" \
  > "$W/write.log" 2>&1 || { echo "the tiny GGUF was not written:"; tail -n 15 "$W/write.log"; \
  tar czf "$OUT/llamacpp_cuda_probe.tgz" -C "$W" .; exit 1; }
G=$W/f32.gguf
declare -A CASE=(
  [Q]="import ctypes, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); p.ftype, p.nthread = 2, 1; print(llama_cpp.llama_model_quantize(b'$G', b'$W/q4_0.gguf', ctypes.byref(p)))"
  [A]="import llama_cpp; m = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); print(m('the', max_tokens=4)['choices'][0]['text'])"
  [B]="import torch; torch.zeros(1, device='cuda'); import llama_cpp; m = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); print(m('the', max_tokens=4)['choices'][0]['text'])"
  [C]="from moedesk.engine.runtime import Engine; e = Engine.load('$G', engine='llama.cpp', device='auto', context_length=64); print(e.device, e.warnings)"
  [D]="from moedesk.engine.runtime import Engine; e = Engine.load('$G', engine='llama.cpp', device='auto', context_length=64, cpu_moe=1); print(e.device, e.overridden)"
  [E]="import torch; import llama_cpp; m = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); print(m('the', max_tokens=4)['choices'][0]['text'])"
  [F]="import llama_cpp; m0 = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); import torch; torch.zeros(1, device='cuda'); m = llama_cpp.Llama('$G', n_gpu_layers=99, verbose=False); print(m('the', max_tokens=4)['choices'][0]['text'])"
)
CASE[M]="from moedesk.engine.llamacpp.library import library; library(); print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libggml' in l or 'libllama' in l}))"
first=""
for mode in copy link; do
  install_llamacpp_libs "$B" $mode; echo "== libraries ${mode}"
  for c in M Q A E B F C D; do
    python3 -c "${CASE[$c]}" > "$W/${mode}_$c.log" 2>&1; rc=$?
    echo "case $c: exit $rc" | tee -a "$W/exits.txt"; tail -n 3 "$W/${mode}_$c.log" | cut -c1-400
    ((rc != 0)) && [ -z "$first" ] && first=$c && firstmode=$mode
  done
done
# Session 35: A alone works, and torch's import in either order breaks it (docs/measurements.md). Which shared
# libraries are there twice, and does E run when llama.cpp takes torch's own CUDA libraries (one copy of each) or
# torch's OpenMP runtime?
TORCH_LIB=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")/lib
TORCH_CU=$(dirname "$TORCH_LIB")/../nvidia/cu13/lib
python3 -c "import torch, llama_cpp; llama_cpp.llama_backend_init(); print(''.join(sorted({l.split()[-1] + '\n' for l in open('/proc/self/maps') if any(n in l for n in ('libstdc++', 'libgomp', 'libcudart', 'libcublas', 'libggml', 'libomp'))})))" \
  > "$W/maps_torch_then_llama.txt" 2>&1; echo "== mapped with torch and llama_cpp's library both loaded:"; cat "$W/maps_torch_then_llama.txt"
ls "$TORCH_LIB" > "$W/torch_lib.txt" 2>&1
for lib in /tmp/site/llama_cpp/lib/libggml-cpu.so /tmp/site/llama_cpp/lib/libggml-base.so /tmp/site/llama_cpp/lib/libllama.so; do
  echo "== $lib"; ldd "$lib"; done > "$W/ldd_ggml_rest.txt" 2>&1
gomp=$(ls "$TORCH_LIB"/libgomp*.so* 2>/dev/null | head -n 1)
for variant in "torch's CUDA libraries first on the path|LD_LIBRARY_PATH=$TORCH_CU:${LD_LIBRARY_PATH:-}" \
    "torch's libgomp preloaded|LD_PRELOAD=${gomp:-/nonexistent}" "system libstdc++ preloaded|LD_PRELOAD=$(ldconfig -p | awk '/libstdc\+\+.so.6 /{print $NF; exit}')"; do
  env "${variant#*|}" python3 -c "${CASE[E]}" > "$W/E_variant.log" 2>&1; rc=$?
  echo "case E, ${variant%%|*}: exit $rc" | tee -a "$W/exits.txt"; tail -n 2 "$W/E_variant.log" | cut -c1-300
done
if [ -n "$first" ] && command -v gdb >/dev/null; then
  install_llamacpp_libs "$B" $firstmode
  gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -c "${CASE[$first]}" > "$W/gdb_$first.txt" 2>&1
  grep -A25 "SIGSEGV" "$W/gdb_$first.txt" | head -n 30
fi
python3 -c "import torch; torch.zeros(1, device='cuda'); print(''.join(sorted({l.split()[-1] + '\n' for l in open('/proc/self/maps') if 'libcu' in l or 'libnv' in l})))" > "$W/torch_maps.txt" 2>&1
ldd /tmp/site/llama_cpp/lib/libggml-cuda.so > "$W/ldd_ggml_cuda.txt" 2>&1
echo "torch maps:"; cat "$W/torch_maps.txt"; echo "libggml-cuda needs:"; grep -i "cu\|nv" "$W/ldd_ggml_cuda.txt"
tar czf "$OUT/llamacpp_cuda_probe.tgz" -C "$W" --exclude='*.gguf' .
