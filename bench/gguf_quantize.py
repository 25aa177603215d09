"""llama.cpp's quantiser for the bench's GGUF files, run in a child process, with `llama-quantize` as the way around.

The parameters are llama.cpp's defaults (llama_model_quantize_default_params: no importance matrix, no overrides,
no pruning) with the file type and a thread count set, as llama-quantize sets them. Threads: the CPUs this process
may run on, not os.cpu_count(): on a GPU host that is every core of the machine (hundreds), where llama-quantize has
been run with 16; a thread llama.cpp cannot start leaves its other workers on a stack being unwound.
The quantiser runs in a child so that a crash in the C library (on the GPU box, the CUDA build's quantiser
ended the whole bench with a segmentation fault) ends only the child: the bench says so in one line and runs
llama.cpp's own `llama-quantize` where one is on PATH.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from moedesk.engine.errors import MoedeskError

# llama.h's LLAMA_FTYPE_* -> the type name llama-quantize takes for it
QUANTIZE_NAMES = {1: "F16", 2: "Q4_0", 7: "Q8_0", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K"}
FALLBACK = "llama-quantize"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def quantize(source: Path, out: Path, file_type: int, log=print, threads: int | None = None) -> None:
    """`source` (F16 GGUF) quantised to llama.cpp file type `file_type` as `out`, through llama-cpp-python's
    library in a child process, else through `llama-quantize` on PATH; MoedeskError (one line) when neither can."""
    threads = threads or usable_cpus()
    partial = out.with_suffix(".partial")
    done = subprocess.run([sys.executable, "-m", "moedesk.bench.gguf_quantize", str(source), str(partial),
                           str(file_type), str(threads)], capture_output=True, text=True)
    if done.returncode == 0 and partial.is_file():
        os.replace(partial, out)
        return
    why = failure(done.returncode, done.stderr)
    tool = shutil.which(FALLBACK)
    if tool is None or file_type not in QUANTIZE_NAMES:
        partial.unlink(missing_ok=True)
        raise MoedeskError(f"{source}: llama.cpp's quantiser failed ({why}); with llama.cpp's {FALLBACK} on PATH "
                           f"the bench uses that instead")
    log(f"llama.cpp's quantiser failed in Python ({why}); quantising with {tool}")
    done = subprocess.run([tool, str(source), str(partial), QUANTIZE_NAMES[file_type], str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise MoedeskError(f"{source}: {tool} failed too ({failure(done.returncode, done.stderr + done.stdout)})")
    os.replace(partial, out)


def failure(returncode: int, output: str) -> str:
    """One line for a child that failed: the signal that killed it, else its last line that names an error."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    named = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
    return (named or lines or [f"exit status {returncode}"])[-1]


def quantize_here(source: str, out: str, file_type: int, threads: int) -> int:
    """llama_model_quantize on the default parameters (kept alive while it runs); 0 when it worked."""
    from llama_cpp import llama_cpp as api  # no torch in this process, no log callback: llama.cpp logs to stderr

    api.llama_backend_init()
    params = api.llama_model_quantize_default_params()
    params.ftype, params.nthread = file_type, threads
    return int(api.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)))


if __name__ == "__main__":
    source, out, file_type, threads = sys.argv[1:5]
    sys.exit(1 if quantize_here(source, out, int(file_type), int(threads)) else 0)
