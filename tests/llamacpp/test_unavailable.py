"""Without a working llama_cpp: one line where llama.cpp is needed, and the native engine goes on working."""
from __future__ import annotations

import sys

import pytest

from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.llamacpp import library


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", None)
    yield


def test_a_missing_llama_cpp_is_one_line_and_native_still_loads(no_llama_cpp, tmp_path):
    from moedesk.engine.runtime import Engine

    problem = library.available()
    assert "llama-cpp-python is not installed" in problem and "\n" not in problem
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(MoedeskError, match="not installed"):
        Engine.load(str(gguf), engine="llama.cpp")
    # auto on a GGUF the native engine refuses: the refusal and why llama.cpp cannot take it, in one line
    from moedesk.engine.selection import after_refusal

    with pytest.raises(UnsupportedModelError, match="minimax-m2.*not installed") as refused:
        after_refusal(UnsupportedModelError(gguf, "unsupported GGUF architecture 'minimax-m2'"))
    assert "\n" not in str(refused.value)
    engine = Engine.load("demo", device="cpu", context_length=64)  # auto: native, which never needs llama_cpp
    assert engine.kind == "native" and engine.why == "native engine: it implements mixtral"


def test_a_library_that_does_not_load_is_one_line(monkeypatch):
    class Unloadable:  # what importing a wheel whose shared library is missing or built for another CPU raises
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "llama_cpp":
                raise OSError("libllama.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(library, "_loaded", None)
    for name in [n for n in sys.modules if n.split(".")[0] == "llama_cpp"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Unloadable(), *sys.meta_path])
    problem = library.available()
    assert "does not load (libllama.so: cannot open shared object file" in problem and "\n" not in problem
    assert "pip install --force-reinstall" in problem


def test_bench_on_llama_cpp_without_it_is_one_line_before_writing_anything(no_llama_cpp, tmp_path, monkeypatch,
                                                                              capsys):
    from moedesk.app.cli import main

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    assert main(["bench", "--engine", "llama.cpp", "--shape", "tiny-moe", "--layers", "2", "--expert-format",
                 "q4_0"]) != 0
    err = capsys.readouterr().err.strip()
    assert "llama-cpp-python is not installed" in err and "\n" not in err
    assert not (tmp_path / "bench-gguf").exists()
