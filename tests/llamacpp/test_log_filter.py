"""llama.cpp's debug lines written during a llama_decode stop in C (engine/llamacpp/log_filter.c): ggml-cuda writes
one for each CUDA graph it replays, every GPU split of every step, and through Python each would take the GIL inside
the step. Lines of other levels, and debug lines outside a decode (a load's name the tensors its overrides moved),
still reach the log."""
import ctypes
import threading

import pytest

from moedesk.engine.llamacpp.library import library, quiet_debug
from moedesk.engine.requests import Request, SamplingParams

DEBUG, INFO, CONT = 1, 2, 5  # ggml.h's ggml_log_level


@pytest.fixture(scope="module")
def write():
    lib = library()
    if lib._filter is None:
        pytest.skip("no C compiler: every line goes to Python")
    log = lib.ggml.ggml_log_internal  # what GGML_LOG_DEBUG and the others call
    log.restype = None
    return lambda level, text: log(level, b"%s", text.encode())


def test_a_quiet_threads_debug_lines_stop_and_the_rest_go_on(write):
    lib = library()
    mark = lib.log_mark()

    def decoding():
        quiet_debug(True)
        try:
            write(DEBUG, "graph replayed ")
            write(CONT, "and continued\n")
            write(INFO, "an info line while quiet\n")
        finally:
            quiet_debug(False)
        write(DEBUG, "a debug line after the decode\n")

    thread = threading.Thread(target=decoding)
    thread.start()
    thread.join()
    write(DEBUG, "another thread's debug line\n")
    lines = lib.log_since(mark)
    assert "an info line while quiet" in lines and "a debug line after the decode" in lines
    assert "another thread's debug line" in lines
    assert not any("replayed" in line or "continued" in line for line in lines)


def test_the_engines_steps_are_quiet(demo_llama, write, monkeypatch):
    engine = demo_llama
    api = engine.llama.api
    real = api.llama_decode

    def decode(ctx, batch):  # as ggml-cuda's graph compute writes inside a step
        write(DEBUG, "CUDA Graph id 7 reused\n")
        write(INFO, "a step's info line\n")
        return real(ctx, batch)

    monkeypatch.setattr(api, "llama_decode", decode)
    mark = library().log_mark()
    engine.complete([Request(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=2, temperature=0))])
    lines = library().log_since(mark)
    assert "a step's info line" in lines
    assert "CUDA Graph id 7 reused" not in lines
