#!/usr/bin/env bash
# Here (not on the GPU box), from the repo root: the ignored folders the GPU box's scripts carry, made from PyPI, since
# a fresh checkout has none of them and the box reaches no registry.
#   .llamacpp     llama-cpp-python's vendor/llama.cpp, without what a CUDA build of llama, llama-bench and
#                 llama-batched-bench never reads (models, docs, tests, the web UI, other GPU vendors' backends)
#   .llamacpp-py  the rest of that sdist, without vendor/ (tests/perf/llamacpp_python_cuda.sh builds it with pip)
#   .pylib        its llama_cpp package, without libraries (tests/perf/llamacpp_libs.sh puts the box's build beside it)
#   .whl          wheels for the box's Python 3.12 of what the project and its tests import and the box's image lacks
# Usage: bash tests/perf/box_carry.sh [VERSION]   (default: the llama-cpp-python installed here, in .venv or python3)
set -euo pipefail
installed="import importlib.metadata as m; print(m.version('llama-cpp-python'))"
version=${1:-$(.venv/bin/python -c "$installed" 2>/dev/null || python3 -c "$installed")}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version"
rm -rf .llamacpp .llamacpp-py .pylib && mkdir -p .pylib
mv "$src/vendor/llama.cpp" .llamacpp
(cd .llamacpp && rm -rf models docs media benches tests .github tools/ui tools/server/public* \
  ggml/src/ggml-{vulkan,sycl,opencl,hexagon,metal,et,webgpu,openvino,cann,virtgpu,musa,zdnn,zendnn,kompute})
rmdir "$src/vendor" 2>/dev/null || rm -rf "$src/vendor"
cp -r "$src/llama_cpp" .pylib/llama_cpp && rm -rf .pylib/llama_cpp/lib
rm -rf "$src/.git" "$src/examples" && mv "$src" .llamacpp-py

# The box's image (../.library/device/KINDS.md lists it) has torch, numpy, httpx, anyio, pytest, transformers and the
# like; a wheel of one of those would shadow the image's own build under /tmp/site, so those are left out.
rm -rf .whl && mkdir .whl
python3 -m pip download -q -d .whl --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any gguf platformdirs textual starlette uvicorn llguidance openai ollama jsonschema \
  scikit-build-core pytest-textual-snapshot diskcache sniffio
have="numpy|torch|httpx|httpcore|h11|anyio|idna|certifi|pyyaml|tqdm|click|rich|markdown_it_py|mdurl|pygments|\
typing_extensions|attrs|jinja2|markupsafe|packaging|pathspec|pluggy|pytest|iniconfig|sentencepiece|requests|urllib3|\
charset_normalizer|filelock|fsspec|huggingface_hub|hf_xet|safetensors|tokenizers|regex|psutil|scipy|setuptools|wheel"
find .whl -name '*.whl' | grep -Ei "/($have)-[0-9]" | xargs -r rm
du -sh .llamacpp .llamacpp-py .pylib .whl
ls .whl
