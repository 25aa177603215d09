"""moedesk's import puts the system libstdc++ in the global symbol scope before torch is imported, so that
llama.cpp's libraries, opened later, find the C++ runtime ahead of torch's (moedesk/libstdcxx.py). What a CUDA
build then does is the GPU box's to show (tests/perf/llamacpp_cuda_torch.sh, cases P and L); here, the order the dynamic
loader reports, the preload's failure paths, and the line a GPU load gives where torch came first."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moedesk import libstdcxx

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux's (ld.so) only")


def run(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (the preload happens once a process) on this checkout's moedesk, and on this
    one's path after it: llama_cpp may come from a folder named on it alone (the GPU box's PYTHONPATH)."""
    path = os.pathsep.join([os.getcwd(), *(p for p in sys.path if p)])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path, **env})


def global_scope_of(stderr: str, library: str) -> list[str]:
    """The global lookup scope (LD_DEBUG=scopes' "scope 0") the loader gave `library` when it opened it."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines[:-1]):
        if "object=" in line and line.split("object=", 1)[1].split()[0].endswith(library):
            head, _, scope = lines[i + 1].partition("scope 0:")
            if scope:
                return scope.split()
    raise AssertionError(f"ld.so reported no scope for {library}")


def libllama_scope(code: str) -> list[str]:
    """The global scope llama.cpp's libllama got when `code` ran in a fresh Python."""
    done = run(code, LD_DEBUG="scopes")
    assert done.returncode == 0, done.stderr[-2000:]
    return global_scope_of(done.stderr, "libllama.so")


@linux
def test_importing_moedesk_puts_libstdcxx_in_the_global_scope_before_torch():
    code = ("import ctypes, sys; everywhere = ctypes.CDLL(None); symbol = '_ZSt9terminatev'  # std::terminate\n"
            "before = hasattr(everywhere, symbol); import moedesk\n"
            "print(before, hasattr(everywhere, symbol), 'torch' in sys.modules)")
    done = run(code)
    assert done.returncode == 0, done.stderr
    before, after, torch_imported = done.stdout.split()
    if before == "True":
        pytest.skip("this Python has libstdc++ in its global scope from the start: nothing for moedesk to add")
    assert (after, torch_imported) == ("True", "False")


@linux
def test_llama_cpps_library_opened_after_torch_finds_libstdcxx_ahead_of_torchs_libraries():
    """The product's path: the CLI's import, then torch, then llama.cpp's library, as Engine.load does them."""
    pytest.importorskip("llama_cpp")
    scope = libllama_scope("import moedesk.app.cli, torch, llama_cpp")
    cxx = next(i for i, path in enumerate(scope) if "libstdc++" in os.path.basename(path))
    torch_libs = [i for i, path in enumerate(scope) if f"{os.sep}torch{os.sep}" in path]
    assert torch_libs, scope  # torch's libtorch_global_deps is opened RTLD_GLOBAL: it is there to be beaten
    assert cxx < min(torch_libs), scope


@linux
def test_without_moedesk_torch_leaves_libstdcxx_out_of_the_global_scope():
    """What the preload changes: the same loads without moedesk's import (the order that crashed on CUDA)."""
    pytest.importorskip("llama_cpp")
    scope = libllama_scope("import torch, llama_cpp")
    before_torch = scope[:min(i for i, path in enumerate(scope) if f"{os.sep}torch{os.sep}" in path)]
    assert not any("libstdc++" in os.path.basename(path) for path in before_torch), scope


def test_the_preload_is_skipped_off_linux(monkeypatch):
    def opened(*args, **kwargs):
        raise AssertionError("no library is opened off Linux")

    monkeypatch.setattr(libstdcxx.sys, "platform", "darwin")
    monkeypatch.setattr(libstdcxx.ctypes, "CDLL", opened)
    assert libstdcxx.preload() is False


@linux
def test_a_missing_libstdcxx_is_false_not_an_error(monkeypatch):
    monkeypatch.setattr(libstdcxx, "SONAME", "libmoedesk-no-such-runtime.so.6")
    assert libstdcxx.preload() is False


@pytest.mark.parametrize("error", [OSError("cannot open shared object file"), TypeError("mode"), RuntimeError()])
def test_the_preload_never_raises(monkeypatch, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(libstdcxx.sys, "platform", "linux")
    monkeypatch.setattr(libstdcxx.ctypes, "CDLL", broken)
    assert libstdcxx.preload() is False


@linux
def test_the_preload_is_true_where_the_loader_finds_libstdcxx():
    assert libstdcxx.preload() is True


@linux
@pytest.mark.parametrize("order, expected", [("moedesk, torch", "True"), ("torch, moedesk", "False")])
def test_moedesk_knows_whether_it_came_before_torch(order, expected):
    done = run(f"import {order}; from moedesk import libstdcxx; print(libstdcxx.before_torch)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_a_gpu_load_after_torch_came_first_is_one_line_and_nothing_else_is():
    from moedesk.engine.llamacpp.library import torch_first_hint

    line = torch_first_hint(on_gpu=True, before_torch=False, linux=True)
    assert "\n" not in line and "import moedesk first" in line
    assert torch_first_hint(on_gpu=False, before_torch=False, linux=True) is None  # the CPU build does not crash
    assert torch_first_hint(on_gpu=True, before_torch=True, linux=True) is None
    assert torch_first_hint(on_gpu=True, before_torch=False, linux=False) is None


def test_a_cpu_load_says_nothing_of_torchs_order(tmp_path, monkeypatch, capsys):
    from moedesk.engine.runtime import Engine
    from tests.load.test_packed_experts import write_f32_moe

    write_f32_moe(tmp_path / "f32.gguf", "llama", L=1)
    monkeypatch.setattr(libstdcxx, "before_torch", False)
    engine = Engine.load(str(tmp_path / "f32.gguf"), engine="llama.cpp", device="cpu", context_length=64)
    engine.close()
    assert not any("torch was imported" in w for w in engine.warnings)
    assert "torch was imported" not in capsys.readouterr().err


def test_a_gpu_load_after_torch_came_first_says_so_on_stderr_before_reading_the_file(tmp_path, monkeypatch, capsys):
    """Before the load: a crash inside llama.cpp would take the engine's warnings with it."""
    import moedesk.engine.llamacpp.engine as llama_engine
    from moedesk.engine.llamacpp.fit import Machine
    from moedesk.engine.runtime import Engine

    class Reached(Exception):
        pass

    def read_header(path):
        raise Reached()

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(libstdcxx, "before_torch", False)
    monkeypatch.setattr(llama_engine.sys, "platform", "linux")
    monkeypatch.setattr(llama_engine, "this_machine", lambda device: Machine(True, 0, 1 << 30))
    monkeypatch.setattr(llama_engine, "read_header", read_header)
    with pytest.raises(Reached):
        Engine.load(str(tmp_path / "m.gguf"), engine="llama.cpp", device="auto", context_length=64)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moedesk: torch was imported before moedesk"), err
