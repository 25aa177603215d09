"""A decode step's MoE layers handed between the GPU and the host through flags in pinned memory.

With experts in RAM, every MoE layer of a decode step goes GPU (attention, routing) → host (experts) → GPU. Launching
a CUDA graph per segment and waiting on an event per layer costs the host time every layer (recording the event,
bookkeeping, queueing the copy back, launching the next graph; docs/measurements.md, "The GPU kernels"). Here the
whole step is one graph: after each MoE layer's routing one kernel writes the routing into pinned memory and then the
step's number into the layer's `ready` flag (`signal`), and the next spins on the GPU until the host has written the
same number into the layer's `done` flag, and copies the host's results in; the host, meanwhile, waits for `ready`,
computes the experts and sets `done`. Nothing is launched between layers, and the GPU does its own share of the layer
(resident experts, zero-copy ones) while it waits.

The step's number comes from the host (`next_step`) and a kernel reads it at the graph's start, so a step
that failed half-way cannot leave the two sides counting differently. Both waits give up after a bound
(the GPU's, so that a host that died cannot hang the device; the host's raises), and `release` lets a
waiting GPU go on when the host gives up on a step.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from moedesk.kernels.gpu_zero_copy import pointer_arg
from moedesk.kernels.native_build import open_library

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

SOURCE = Path(__file__).with_name("host_handoff.c")
FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall"]
# The GPU's wait gives up after this many reads of the flag (each a PCIe round trip of ~1 µs: ~30 s).
GPU_SPINS = 1 << 25
COPY_BLOCK = 2048  # elements of the host's results each program of the wait copies

_state: dict = {}
_lock = threading.Lock()


def native():
    """The built host-side library, or None with the reason in `why_not()`."""
    with _lock:
        if not _state:
            lib, reason = open_library(SOURCE, FLAGS, None, "moe_handoff_supported", "")
            if lib is not None:
                lib.moe_wait_flag.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64]
                lib.moe_wait_flag.restype = ctypes.c_int
            _state.update(lib=lib, reason=reason)
    return _state["lib"]


def why_not() -> str | None:
    native()
    return _state["reason"]


def handoff_wanted() -> bool:
    """Whether decode may hand layers over this way: Triton and the native part there, and not turned off by
    MOEDESK_NO_HANDOFF=1 (which compares it with one graph per segment, or steps around a problem). Never with
    CUDA_LAUNCH_BLOCKING=1 (a debugging aid): a launch that returns only once its graph has run would wait
    for a host that is still inside the launch. Nor without decode graphs (MOEDESK_NO_CUDA_GRAPHS=1): nothing to
    hand over from."""
    if any(_flag_set(name) for name in ("MOEDESK_NO_HANDOFF", "CUDA_LAUNCH_BLOCKING", "MOEDESK_NO_CUDA_GRAPHS")):
        return False
    return triton is not None and native() is not None


def _flag_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


class HandoffTimeout(RuntimeError):
    """The GPU did not reach a layer's routing in time."""


class Handoff:
    """Flags for `layers` MoE layers: the graph calls `start` once, then `signal(j)` after layer j's routing
    is copied to the host and `wait(j)` before reading the host's results; the host calls `next_step` before
    replaying the graph, then `host_wait(j)` and `host_done(j)` for each layer in order."""

    def __init__(self, layers: int, device: torch.device):
        lib = native()
        if lib is None:
            raise RuntimeError(f"the host handoff's native part is not available: {why_not()}")
        self._wait_flag = lib.moe_wait_flag
        self.layers = layers
        pinned = torch.device(device).type == "cuda"  # (the host's side alone runs anywhere: how CI tests it)
        self.flags = torch.zeros(2, layers, dtype=torch.int32, pin_memory=pinned)  # ready, done
        self._flags = self.flags.numpy()
        self._ready_ptr, self._stride = self.flags.data_ptr(), self.flags.element_size()
        self.step_host = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self.step_device = torch.zeros(1, dtype=torch.int32, device=device)
        self.step = 0

        self._ready = [_Ready(self, j) for j in range(layers)]

    def warm_up(self, src: torch.Tensor, dst: torch.Tensor, *signalled: torch.Tensor) -> None:
        """Compile the GPU's kernels before a capture (they cannot compile inside one): waits already satisfied,
        with and without the copies the capture will ask for (of `src` into `dst`), and a signal copying into the
        pinned tensors `signalled` (from device tensors like them, as the capture's will be)."""
        self.next_step()
        self.start()
        self.signal(0, *((torch.empty_like(host, device=self.step_device.device), host) for host in signalled))
        self.release()
        for j in range(self.layers):
            self.wait(j)
            self.wait(j, src, dst)
        if self.step_device.is_cuda:
            torch.cuda.synchronize(self.step_device.device)

    # The graph's side (captured). Host memory is read by kernels, not by copies out of it: a graph's copy from
    # pinned memory is one more use torch's pinned-memory cache must track across captures, and a kernel that
    # waits and then copies is one launch where a wait and a copy were two.
    def start(self) -> None:
        _load_step[(1,)](pointer_arg(self.step_host), self.step_device)

    def signal(self, j: int, *copies: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Tell the host that layer j's routing is there: first copy each (device tensor, pinned host tensor) pair
        of `copies` (the routing itself), then set the layer's `ready` flag, in one kernel: as three copies (x, ids,
        flag) each waited for the one before (tests/perf/probe_segment.py; docs/measurements.md, "The GPU kernels")."""
        if len(copies) > 2:
            raise ValueError("signal copies at most two tensors")
        words = []
        for device, host in copies:
            d, h = _words(device), _words(host)
            if d.numel() != h.numel() or not d.is_cuda:
                raise ValueError("each copy goes from a device tensor to a host tensor of its size")
            words.append((d, h, d.numel()))
        words += [(self.step_device, self.step_device, 0)] * (2 - len(words))  # nothing to copy
        (a, a_host, a_len), (b, b_host, b_len) = words
        _signal[(1,)](a, pointer_arg(a_host), a_len, b, pointer_arg(b_host), b_len,
                      pointer_arg(self.flags[0, j:j + 1]), self.step_device, BLOCK=1024, num_warps=8)

    def wait(self, j: int, src: torch.Tensor | None = None, dst: torch.Tensor | None = None) -> None:
        """Wait for the host's layer j, then copy `src` (its results, contiguous in pinned memory) into `dst`."""
        n = 0 if src is None else src.numel()
        if n and (dst is None or dst.numel() != n or not (src.is_contiguous() and dst.is_contiguous())):
            raise ValueError("src and dst must be contiguous and of one size")
        if not n:
            src = dst = self.step_device
        _await_flag[(max(1, triton.cdiv(n, COPY_BLOCK)),)](
            pointer_arg(self.flags[1, j:j + 1]), self.step_device, pointer_arg(src), dst, n,
            SPINS=GPU_SPINS, BLOCK=COPY_BLOCK, num_warps=4)

    # The host's side.
    def next_step(self) -> None:
        self.step = self.step % 0x7FFFFFFF + 1  # never 0, the flags' value before the first step
        self.step_host[0] = self.step

    def host_wait(self, j: int, timeout_s: float = 60.0) -> None:
        if self._wait_flag(self._ready_ptr + j * self._stride, self.step, int(timeout_s * 1e9)):
            raise HandoffTimeout(f"the GPU did not reach MoE layer {j}'s routing within {timeout_s:.0f} s")

    def ready(self, j: int) -> "_Ready":
        """Layer j's routing as an event to wait for (engine.offload.expert_executor.HostRouting.ready)."""
        return self._ready[j]

    def host_done(self, j: int) -> None:
        self._flags[1, j] = self.step

    def release(self) -> None:
        """Let a GPU waiting on this step's layers go on (the host gave up on the step: its results are wrong)."""
        self._flags[1, :] = self.step


class _Ready:
    def __init__(self, handoff: Handoff, j: int):
        self.handoff, self.j = handoff, j

    def synchronize(self) -> None:
        self.handoff.host_wait(self.j)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as int32 words (what the signal kernel copies)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        raise ValueError("a copied tensor must be contiguous and a whole number of 4-byte words")
    return t.view(-1).view(torch.int32)


if triton is not None:
    @triton.jit
    def _fence_system(value):
        """`value`, after a system-scope fence: every write this thread made, or saw through a barrier, is visible to
        the host before any write it makes after (the host reads the routing once it sees the flag)."""
        return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [value], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _signal(a_ptr, a_host, A, b_ptr, b_host, B, flag_ptr, step_ptr, BLOCK: tl.constexpr):
        """One program: copy A words of a and B of b into host memory, then the step's number into the flag. The
        stores to the host write through the L2, and the flag's waits for all of them (a barrier, then a
        system-scope fence in every thread)."""
        for start in range(0, A, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < A
            tl.store(a_host + offs, tl.load(a_ptr + offs, mask=inside), mask=inside, cache_modifier=".wt")
        for start in range(0, B, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < B
            tl.store(b_host + offs, tl.load(b_ptr + offs, mask=inside), mask=inside, cache_modifier=".wt")
        tl.debug_barrier()
        first = tl.arange(0, BLOCK) == 0  # every thread fences; the one holding element 0 stores the flag
        step = tl.load(step_ptr + tl.zeros([BLOCK], dtype=tl.int32))
        tl.store(flag_ptr + tl.zeros([BLOCK], dtype=tl.int32), _fence_system(step), mask=first, cache_modifier=".wt")

    @triton.jit
    def _load_step(src_ptr, dst_ptr):
        tl.store(dst_ptr, tl.load(src_ptr, volatile=True))

    @triton.jit
    def _await_flag(flag_ptr, step_ptr, src_ptr, dst_ptr, N, SPINS: tl.constexpr, BLOCK: tl.constexpr):
        """Every program spins until the host's flag holds the step, then copies its block of src into dst. The
        loads from host memory are volatile: a line the GPU cached in an earlier step would be stale."""
        want = tl.load(step_ptr)
        seen = tl.load(flag_ptr, volatile=True)
        spins = 0
        while (seen != want) & (spins < SPINS):
            seen = tl.load(flag_ptr, volatile=True)
            spins += 1
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < N
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=inside, volatile=True), mask=inside)
