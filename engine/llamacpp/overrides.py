"""Tensor buffer overrides through llama.cpp's ctypes API: the mechanism behind its `-ot` and `--n-cpu-moe`.

llama-cpp-python's `Llama()` does not expose `llama_model_params.tensor_buft_overrides`, so the NULL-terminated
array of (regex, buffer type) pairs is built here and kept alive for as long as llama.cpp may read it (the load).
"""
from __future__ import annotations

import ctypes
import re


class BufferOverride(ctypes.Structure):
    """llama.h's `struct llama_model_tensor_buft_override`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def experts_pattern(layers: list[int]) -> str | None:
    """A regex (std::regex, searched in each tensor's name) for the routed experts of `layers`; None for none."""
    if not layers:
        return None
    return r"^blk\.(" + "|".join(str(i) for i in sorted(set(layers))) + r")\.ffn_(gate|up|down|gate_up)_(ch)?exps\."


def matches(pattern: str, name: str) -> bool:
    """What llama.cpp's std::regex_search does with the pattern (ECMAScript syntax, which Python's re reads alike
    for these patterns): tests check the choice without loading a model."""
    return re.search(pattern, name) is not None


class Overrides:
    """The array for `llama_model_params.tensor_buft_overrides`; `install(params)` points the params at it."""

    def __init__(self, rules: list[tuple[str, int]]):
        self.rules = rules
        self._patterns = [pattern.encode() for pattern, _ in rules]  # the array holds pointers into these
        self._array = (BufferOverride * (len(rules) + 1))()
        for i, ((_, buft), pattern) in enumerate(zip(rules, self._patterns)):
            self._array[i].pattern, self._array[i].buft = pattern, buft
        # The last entry stays zeroed: the NULL pattern that ends the list.

    def install(self, params) -> None:
        params.tensor_buft_overrides = ctypes.cast(self._array, ctypes.c_void_p) if self.rules else None


OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
MAPPED = re.compile(r"loading model tensors.*\(load_mode = mmap")


def overridden_tensors(log_lines) -> dict[str, str]:
    """Tensor name -> the buffer type llama.cpp keeps it in, from the lines it logs while it applies overrides at
    load. It logs its first choice, which on a GPU build is the GPU's pinned host memory ("CUDA_Host": the GPU then
    copies it faster for a large batch); with the file memory-mapped its loader then takes the CPU's own buffer
    instead (llama-model-loader.cpp: "avoid using a host buffer when using mmap"), and so does this."""
    found, mapped = {}, False
    for line in log_lines:
        mapped = mapped or MAPPED.search(line) is not None
        if m := OVERRIDDEN.search(line):
            found[m.group(1)] = "CPU" if mapped and m.group(2).endswith("_Host") else m.group(2)
    return found
