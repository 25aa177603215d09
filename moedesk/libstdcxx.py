"""The system's C++ runtime in the process's global symbol scope, ahead of torch's libraries.

llama.cpp's CUDA build (libggml-cuda, opened by llama-cpp-python) crashes when it loads after `import torch`, and
loads and runs when libstdc++ is preloaded (docs/measurements.md, session 36): torch opens libraries of its own
with RTLD_GLOBAL, and without libstdc++ ahead of them some of llama.cpp's C++ symbols bind there instead. Loading
libstdc++ RTLD_GLOBAL before torch's first import gives every later library the lookup order LD_PRELOAD gives.
"""
from __future__ import annotations

import ctypes
import sys

# A bare soname is searched for the way the dynamic loader finds a NEEDED entry (LD_LIBRARY_PATH, ld.so.cache,
# the default folders): the copy llama.cpp's libraries would get. ctypes.util.find_library would start a
# subprocess at every import.
SONAME = "libstdc++.so.6"

before_torch = False  # set by moedesk's import: whether preload() ran, and worked, before torch was first imported


def preload() -> bool:
    """Load libstdc++ into the global scope (Linux only). True when it is there, False when not: no Linux, no
    libstdc++ the loader can find, or any other failure. Never raises: a process without it still runs."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(SONAME, mode=ctypes.RTLD_GLOBAL)
    except Exception:  # noqa: BLE001 -- an import must not fail over a workaround
        return False
    return True
