"""Whether llama.cpp's extra CPU weight buffers (AMX, repacked) run on this machine.

On a CPU that advertises AMX-INT8, llama.cpp repacks the weights it keeps in RAM for its AMX kernels. On some
machines that kernel faults (SIGSEGV at `ldtilecfg`, seen on a 2026 CI VM whose own AMX code here runs fine) and
ends the process, which no Python code can catch. So the first llama.cpp load on such a CPU decodes the demo's
GGUF in a child process, once per machine and llama-cpp-python version (cached); where the child died of a
signal, loads turn the extra buffers off (`use_extra_bufts`), which costs llama.cpp's CPU side those kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moedesk.engine.hardware import machine_fingerprint
from moedesk.engine.json_cache import cached_json

# The child: the demo's GGUF (SmolLM2, Q4_1: a type llama.cpp's AMX kernels take) through llama-cpp-python, one
# prompt decoded, as the engine's first step would.
CHILD = """
import moedesk  # the C++ runtime preload, as in the engine's process
from llama_cpp import Llama
from moedesk.engine.load.demo import source_gguf
llm = Llama(model_path=str(source_gguf()), n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
llm.eval(llm.tokenize(b"The capital of France is"))
"""
PROBE_S = 180


def cpu_advertises_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU flags (Linux's /proc/cpuinfo) list AMX-INT8, which makes llama.cpp use its AMX buffers."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_int8" in line.split() for line in cpuinfo.splitlines())


def extra_buffers_safe(cache_dir: Path, version: str, run=None) -> bool:
    """False where a child process decoding with llama.cpp's extra buffers died of a signal on this machine.

    run: what runs the child, returning its exit status (tests); a child that could not run its code (an exit
    status > 0: no demo file, say) decides nothing, and the buffers stay on."""
    if not cpu_advertises_amx():
        return True
    path = Path(cache_dir) / f"llamacpp-extra-buffers-{machine_fingerprint()}-{version}.json"
    return bool(cached_json(path, lambda: {"safe": (run or _run_child)() >= 0})["safe"])


def _run_child() -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=PROBE_S).returncode
    except (OSError, subprocess.TimeoutExpired):
        return 1
