#!/usr/bin/env bash
# llama.cpp's own server tests against `moedesk serve` (issue 43.5), from the repository root, on any machine:
#   bash tests/perf/llama_server_suite.sh LLAMA_CPP_DIR [FILES...] [--log FILE]
# LLAMA_CPP_DIR: a llama.cpp tree with tools/server/tests (docs/serve.md, "Conformance", says where to get one).
# Prints the pass/fail tally per file; the runner and its adapter are tests/serve/llama_server_suite.py.
set -euo pipefail
exec python3 -m tests.serve.llama_server_suite "$@"
