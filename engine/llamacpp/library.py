"""llama-cpp-python's bundled llama.cpp, loaded once: its ctypes API, its ggml devices and its log.

A missing or broken `llama_cpp` is one line (LlamaCppUnavailable); the native engine never imports this module.
"""
from __future__ import annotations

import collections
import ctypes
import threading
from pathlib import Path

from moedesk.engine.errors import MoedeskError

CUDA_REBUILD = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'
LOG_LINES = 4000  # the newest lines of llama.cpp's log that are kept: a model load writes a few hundred


class LlamaCppUnavailable(MoedeskError):
    """llama-cpp-python cannot be imported or its library cannot be loaded."""


class _Library:
    """The loaded library: `api` is llama_cpp.llama_cpp (the ctypes bindings), `ggml` libggml for devices."""

    def __init__(self):
        try:
            import llama_cpp
            from llama_cpp import llama_cpp as api
        except ImportError as e:
            raise LlamaCppUnavailable(f"llama.cpp engine unavailable: llama-cpp-python is not installed ({e}); "
                                      f"pip install llama-cpp-python") from None
        except OSError as e:  # the wheel is there but its shared library does not load
            raise LlamaCppUnavailable(f"llama.cpp engine unavailable: llama-cpp-python's library does not load "
                                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); reinstall it "
                                      f"with pip install --force-reinstall --no-cache-dir llama-cpp-python") from None
        self.api, self.version = api, getattr(llama_cpp, "__version__", "?")
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._partial, self.written = "", 0
        self._lock = threading.Lock()
        self._callback = api.llama_log_callback(self._log)  # kept: llama.cpp holds only the pointer
        self._filter, self._forward = _log_filter(), None
        if self._filter is not None:
            # log_filter.c in front: a decoding thread's debug lines stop in C (quiet_debug)
            self._forward = _Forward(ctypes.cast(self._callback, ctypes.c_void_p).value, None)
            api.llama_log_set(api.llama_log_callback(ctypes.cast(self._filter.moedesk_log, ctypes.c_void_p).value),
                              ctypes.addressof(self._forward))
        else:
            api.llama_log_set(self._callback, None)
        api.llama_backend_init()
        self.ggml = _ggml(Path(llama_cpp.__file__).parent / "lib")

    def _log(self, level, text, user_data) -> None:
        # llama.cpp writes a line in several calls; only whole lines are kept.
        with self._lock:
            self._partial += text.decode("utf-8", errors="replace") if text else ""
            *whole, self._partial = self._partial.split("\n")
            self.lines.extend(whole)
            self.written += len(whole)

    def log_mark(self) -> int:
        """A position in the log: `log_since(mark)` gives the lines written after it."""
        with self._lock:
            return self.written

    def log_since(self, mark: int) -> list[str]:
        with self._lock:
            lines = list(self.lines)
            new = self.written - mark
        return lines[len(lines) - min(new, len(lines)):]

    def devices(self) -> list[tuple[str, str]]:
        """(name, kind) of every ggml device: kind "cpu", "gpu", "igpu" or "accel" (ggml_backend_dev_type)."""
        kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
        found = []
        for i in range(self.ggml.ggml_backend_dev_count()):
            dev = self.ggml.ggml_backend_dev_get(i)
            found.append((self.ggml.ggml_backend_dev_name(dev).decode(), kinds.get(self.ggml.ggml_backend_dev_type(dev), "?")))
        return found

    def cpu_buffer_type(self) -> int:
        """The CPU device's buffer type (a pointer): what experts pinned to RAM are allocated in."""
        for i in range(self.ggml.ggml_backend_dev_count()):
            dev = self.ggml.ggml_backend_dev_get(i)
            if self.ggml.ggml_backend_dev_type(dev) == 0:
                return self.ggml.ggml_backend_dev_buffer_type(dev)
        raise MoedeskError("llama.cpp has no CPU device")

    def gpu_offload(self) -> bool:
        return bool(self.api.llama_supports_gpu_offload())


class _Forward(ctypes.Structure):
    """log_filter.c's `struct forward`: the Python callback it passes lines on to."""

    _fields_ = [("log", ctypes.c_void_p), ("user_data", ctypes.c_void_p)]


LOG_FILTER = Path(__file__).with_name("log_filter.c")


def _log_filter():
    """log_filter.c built and loaded; None where it cannot be built (every line then goes to Python)."""
    from moedesk.kernels.native_build import BuildError, build_library, find_compiler

    if find_compiler() is None:
        return None
    try:
        filt = ctypes.CDLL(str(build_library(LOG_FILTER, ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall"])))
    except (BuildError, OSError):
        return None
    filt.moedesk_log_quiet.argtypes, filt.moedesk_log_quiet.restype = [ctypes.c_bool], None
    return filt


def quiet_debug(on: bool) -> None:
    """While on, llama.cpp's debug lines written on this thread are dropped before Python: around a llama_decode,
    where ggml-cuda writes one for each CUDA graph it replays. Other levels, and other threads, are kept."""
    if _loaded is not None and _loaded._filter is not None:
        _loaded._filter.moedesk_log_quiet(on)


def _ggml(folder: Path):
    """libggml's device and tensor functions (llama-cpp-python binds llama.h only; dlsym through libggml's handle
    finds libggml-base's functions too)."""
    lib = ctypes.CDLL(str(folder / "libggml.so")) if (folder / "libggml.so").exists() else ctypes.CDLL(
        str(next(folder.glob("*ggml.*"))))
    p, size = ctypes.c_void_p, ctypes.c_size_t
    for name, restype, argtypes in (("ggml_backend_dev_count", size, []), ("ggml_backend_dev_get", p, [size]),
                                    ("ggml_backend_dev_name", ctypes.c_char_p, [p]),
                                    ("ggml_backend_dev_type", ctypes.c_int, [p]),
                                    ("ggml_backend_dev_buffer_type", p, [p]),
                                    ("ggml_backend_buft_name", ctypes.c_char_p, [p]),
                                    # what engine.llamacpp.expert_counts reads of a graph node
                                    ("ggml_get_name", ctypes.c_char_p, [p]), ("ggml_nbytes", size, [p]),
                                    ("ggml_op_desc", ctypes.c_char_p, [p]),
                                    ("ggml_backend_tensor_get", None, [p, p, size, size])):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_loaded: _Library | None = None
_loading = threading.Lock()


def library() -> _Library:
    """The library, loaded at the first call; LlamaCppUnavailable (one line) when it cannot be."""
    global _loaded
    with _loading:
        if _loaded is None:
            _loaded = _Library()
        return _loaded


def available() -> str | None:
    """None when llama.cpp can run here, else the one line that says why not."""
    try:
        library()
    except LlamaCppUnavailable as e:
        return str(e)
    return None


def torch_first_hint(on_gpu: bool, before_torch: bool, linux: bool) -> str | None:
    """The line for a load onto llama.cpp's GPU in a process whose libstdc++ did not go in ahead of torch's libraries
    (torch imported before moedesk: moedesk/libstdcxx.py), where llama.cpp's CUDA build can crash; None otherwise."""
    if on_gpu and linux and not before_torch:
        return ("torch was imported before moedesk, and llama.cpp's CUDA build can crash beside it: import moedesk "
                "first (or run with LD_PRELOAD=libstdc++.so.6)")
    return None


def cuda_hint(nvidia_gpus: int, gpu_offload: bool) -> str | None:
    """The one line for a machine with an NVIDIA GPU whose llama.cpp was built without CUDA; None otherwise."""
    if nvidia_gpus and not gpu_offload:
        return f"llama.cpp was built without CUDA and runs on the CPU only; rebuild it with: {CUDA_REBUILD}"
    return None
