# Sourced by the GPU box's scripts: llama-cpp-python's package (.pylib, without its libraries) under /tmp/site, over
# the llama.cpp libraries built in the folder $1 (tests/perf/llamacpp_engine_gpu.sh build), linked by default.
# Linked, not copied: libllama's RUNPATH finds libggml in the build folder while llama_cpp and
# engine/llamacpp/library.py open the package's copy by path, and a copy (another inode) would be mapped a second
# time, with a second ggml backend registry. `copy` keeps the old way, for tests/perf/llamacpp_cuda_probe.sh.
install_llamacpp_libs() {
  local build=$1 how=${2:-link}
  rm -rf /tmp/site/llama_cpp && cp -r .pylib/llama_cpp /tmp/site/ && mkdir -p /tmp/site/llama_cpp/lib
  if [ "$how" = copy ]; then
    find "$build" -name 'lib*.so*' -exec cp -a {} /tmp/site/llama_cpp/lib/ \;
  else
    find "$build" -name 'lib*.so*' -exec sh -c 'ln -sf "$(readlink -f "$1")" "/tmp/site/llama_cpp/lib/${1##*/}"' _ {} \;
  fi
}
