"""llama.cpp's own account of the memory it took: the buffer sizes its load and its context creation log.

Lines such as "CUDA0 model buffer size = 3254.20 MiB", "CPU_Mapped model buffer size = ...", "CUDA0 KV buffer
size = ...", "CUDA0 compute buffer size = ...", "CUDA_Host compute buffer size = ...", and a recurrent model's
"CUDA0 RS buffer size = ..." (its layers' state, beside the KV cache): where (the buffer type's name) and what
(model, KV, RS, compute, output), in MiB with two decimals. What the estimate in engine.llamacpp.fit
and engine.llamacpp.compute is checked against.
"""
from __future__ import annotations

import re

_LINE = re.compile(r"(\S+)\s+(model|KV|RS|compute|output) buffer size =\s+([\d.]+) MiB")


def llama_buffers(log) -> dict[tuple[str, str], int]:
    """{(where, what): bytes} over the log's lines, summed where a buffer type appears more than once."""
    found: dict[tuple[str, str], int] = {}
    for line in log:
        if m := _LINE.search(line):
            key = (m.group(1), m.group(2))
            found[key] = found.get(key, 0) + round(float(m.group(3)) * 2**20)
    return found


def in_ram(where: str) -> bool:
    """Whether a buffer type's memory is the host's: the CPU's own (CPU, CPU_Mapped, CPU_REPACK..., and AMX, the
    CPU backend's repacked weights on an AMX CPU, the one not named CPU_) or what a GPU backend pins for its
    transfers (CUDA_Host)."""
    return where.startswith("CPU") or where.endswith("_Host") or where == "AMX"


def on_device(buffers: dict[tuple[str, str], int]) -> dict[str, int]:
    """{what: bytes} of the buffers in the GPU's own memory (every buffer type not `in_ram`)."""
    found: dict[str, int] = {}
    for (where, what), size in buffers.items():
        if not in_ram(where):
            found[what] = found.get(what, 0) + size
    return found


_FAILED = re.compile(r"failed to allocate (\S+) buffer of size (\d+)")


def failed_gpu_bytes(log) -> int | None:
    """Bytes of the largest buffer the log says llama.cpp could not allocate in a GPU's own memory (as
    ggml's allocators word it: "failed to allocate CUDA0 buffer of size 1073741824"); None when no GPU allocation
    failed (one in RAM did, or something else went wrong)."""
    sizes = [int(m.group(2)) for line in log if (m := _FAILED.search(line))
             and not in_ram(m.group(1))]
    return max(sizes, default=None)
