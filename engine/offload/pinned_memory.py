"""Host memory for the expert banks: one exact-size arena per MoE layer, page-locked in place once filled.

torch's pinned allocator (cudaHostAlloc behind its caching host allocator) rounds every allocation up to a power of
two and zero-fills and locks all of it before the loader writes a byte, so a model's experts took far more locked RAM
than their size (issue 17; docs/measurements.md, "The offload executor and the pinned banks"). Here a layer's two
stacks are views of one anonymous mapping of exactly their bytes (each stack starts on a page, so at most a page is
added per stack); the loader fills it as ordinary memory, and cudaHostRegister then locks those pages where they are,
on a background thread while the loader fills the next layer. The registration is undone when the last tensor viewing
the arena is freed, just before the mapping goes.

Without CUDA the arenas stay ordinary memory. When locking fails (the driver refuses: out of memory, a locked
memory limit) the layers not yet locked stay ordinary memory, slower to copy to the GPU, and one warning
line says how much.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moedesk.kernels.expert_weights import ExpertWeights

log = logging.getLogger("moedesk")

GIB = 2**30
PAGE = mmap.PAGESIZE

# Portable: locked for every CUDA context, not only the current device's. Mapped: the device may read the
# pages through their host address (UVA), which kernels/gpu_zero_copy.py does; on UVA systems the default
# flags imply both, said here so the zero-copy kernels never depend on that.
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


class PinError(RuntimeError):
    """The driver would not page-lock a range (the message is its reason, one line)."""


class CudaRegistrar:
    """Page-locks host ranges with cudaHostRegister (torch's binding of the CUDA runtime)."""

    flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED

    def __init__(self):
        self._cudart = torch.cuda.cudart()

    def register(self, address: int, nbytes: int) -> None:
        # The binding releases the GIL, so the loader's threads keep filling while the driver locks pages. A
        # failure is also left as the runtime's last error, but that is per host thread, and this runs on the
        # banks' own worker thread, so no later launch elsewhere reports it.
        error = self._cudart.cudaHostRegister(address, nbytes, self.flags)
        if int(error) != 0:
            raise PinError(str(self._cudart.cudaGetErrorString(error)))

    def unregister(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)


class _Mapping(mmap.mmap):
    """An anonymous mapping that undoes its page-lock before it is unmapped.

    torch.frombuffer keeps this object alive for as long as any tensor views it, so it is finalised only
    once the last view of the bank is gone (nothing can still copy from it), and munmap follows right after.
    """

    registered = None  # (unregister, address) once page-locked

    def __del__(self):
        registered, self.registered = self.registered, None
        if registered is not None and not _exiting:
            unregister, address = registered
            try:
                unregister(address)
            except Exception:  # noqa: BLE001  (at interpreter exit CUDA may already be gone; the OS frees all)
                pass


_exiting = False


@atexit.register
def _leave_locks_to_the_os() -> None:
    # Arenas still alive at exit are finalised while CUDA is being torn down; the process's end frees and unlocks
    # them anyway, so they are not unregistered then.
    global _exiting
    _exiting = True


class HostArena:
    """Exactly `nbytes` (rounded up to whole pages) of anonymous memory, handed out as tensors by `take`."""

    def __init__(self, nbytes: int, huge_pages: bool = False):
        self.nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self._mapping = _Mapping(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE
        try:
            # Small pages unless asked: the CPU expert kernel read banks backed by transparent huge pages more slowly
            # than cudaHostAlloc's small pages (tests/perf/probe_bank_pages.py; docs/measurements.md, "The offload
            # executor and the pinned banks"), and decode speed is that bandwidth.
            self._mapping.madvise(advice)
        except (OSError, AttributeError):  # a kernel without transparent huge pages
            pass
        self.address = torch.frombuffer(self._mapping, dtype=torch.uint8, count=1).data_ptr()
        self._used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The next page-aligned piece of the arena as an uninitialised tensor of `shape` and `dtype`."""
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        if self._used + nbytes > self.nbytes:
            raise ValueError(f"arena of {self.nbytes} bytes has no room for {nbytes} more at {self._used}")
        tensor = torch.frombuffer(self._mapping, dtype=dtype, count=count, offset=self._used).view(shape)
        self._used += -(-nbytes // PAGE) * PAGE
        return tensor

    @property
    def pinned(self) -> bool:
        return self._mapping.registered is not None

    def register(self, registrar) -> None:
        """Page-lock the whole arena with `registrar` (raises PinError); undone when the arena's memory is freed."""
        registrar.register(self.address, self.nbytes)
        self._mapping.registered = (registrar.unregister, self.address)


def stack_shapes(experts: int, hidden: int, width: int, dtype: torch.dtype, gate_up_format: str,
                 down_format: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of a layer's gate_up and down stacks in these formats (kernels.expert_weights)."""
    meta = ExpertWeights.empty(experts, hidden, width, dtype=dtype, gate_up_format=gate_up_format,
                               down_format=down_format, device="meta")
    return [(tuple(t.shape), t.dtype) for t in (meta.gate_up, meta.down)]


def arena_bytes(shapes) -> int:
    """Bytes an arena needs for these stacks, each starting on a page."""
    return sum(-(-_nbytes(shape, dtype) // PAGE) * PAGE for shape, dtype in shapes)


def _nbytes(shape, dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


class HostBanks:
    """The loader's `expert_banks` (engine.load.loader.load_model): a host arena per MoE layer, page-locked
    layer by layer as the loader reports each one filled.

    pinned: lock the arenas (a GPU will copy from them). registrar: what locks them (default: CudaRegistrar
    when pinned; tests pass a fake). warnings: where the one line about memory left unlocked goes.
    `stats` keeps how the time went: allocate_s, pin_s (the registrations themselves, overlapping the fill),
    pin_wait_s (what the loader waited for them after its last tensor), pinned_bytes and unpinned_bytes.
    """

    def __init__(self, dtype: torch.dtype, pinned: bool, warnings: list[str] | None = None, registrar=None,
                 huge_pages: bool = False):
        self.dtype, self.pinned, self.huge_pages = dtype, pinned, huge_pages
        self.warnings = [] if warnings is None else warnings
        self._registrar = registrar
        self.arenas: dict[int, HostArena] = {}
        self._pending: list[Future] = []
        self._worker: ThreadPoolExecutor | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        self.stats = {"allocate_s": 0.0, "pin_s": 0.0, "pin_wait_s": 0.0, "pinned_bytes": 0, "unpinned_bytes": 0}

    def __call__(self, model, formats: dict[int, tuple[str, str]]) -> dict[int, ExpertWeights]:
        """Empty banks for every MoE layer of `model`, in the (gate_up, down) formats the loader chose for each
        (dense ones in `dtype`), made the layers' experts."""
        started = time.perf_counter()
        banks = {}
        for moe in model.moe_blocks():
            placeholder = moe.experts
            shapes = stack_shapes(placeholder.num_experts, placeholder.hidden, placeholder.width, self.dtype,
                                  *formats[moe.layer])
            arena = self.arenas[moe.layer] = HostArena(arena_bytes(shapes), self.huge_pages)
            gate_up, down = (arena.take(shape, dtype) for shape, dtype in shapes)
            moe.experts = banks[moe.layer] = ExpertWeights(gate_up, down, placeholder.hidden, placeholder.width,
                                                           *formats[moe.layer])
        self.stats["allocate_s"] += time.perf_counter() - started
        return banks

    def pinned_copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` copied into an exact-size arena of its own, page-locked now (a GPU reads it in place: the token
        table, engine.model.embedding); None where the banks are not pinned or the driver refuses the lock."""
        if not self.pinned:
            return None
        if self._registrar is None:
            self._registrar = CudaRegistrar()
        arena = HostArena(tensor.numel() * tensor.element_size(), self.huge_pages)
        copy = arena.take(tensor.shape, tensor.dtype)
        copy.copy_(tensor)
        try:
            arena.register(self._registrar)
        except PinError:
            return None
        self.stats["pinned_bytes"] += arena.nbytes
        return copy

    def filled(self, layer: int) -> None:
        """The loader wrote every expert of `layer`: lock its arena in the background."""
        if not self.pinned:
            return
        if self._registrar is None:
            self._registrar = CudaRegistrar()
        if self._worker is None:
            # One thread: the driver locks one range at a time anyway, and a failure's last-error state stays in it.
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="moedesk-pin")
        self._pending.append(self._worker.submit(self._pin, self.arenas[layer]))

    def _pin(self, arena: HostArena) -> None:
        with self._lock:
            if self._failure is not None:  # after one refusal the rest would be refused too, or squeeze the OS
                self.stats["unpinned_bytes"] += arena.nbytes
                return
        started = time.perf_counter()
        try:
            arena.register(self._registrar)
        except PinError as error:
            with self._lock:
                self._failure = str(error).splitlines()[0] if str(error) else type(error).__name__
                self.stats["unpinned_bytes"] += arena.nbytes
            return
        finally:
            self.stats["pin_s"] += time.perf_counter() - started
        self.stats["pinned_bytes"] += arena.nbytes

    def done(self, ok: bool = True) -> None:
        """The loader is finished (ok) or gave up: wait for the locks under way, or drop those not yet begun."""
        started = time.perf_counter()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=not ok)
        self.stats["pin_wait_s"] += time.perf_counter() - started
        if ok:
            for future in self._pending:
                future.result()  # anything but a refusal (a bug) is raised here, not lost in the thread
        self._pending = []
        if ok and self._failure is not None:
            left = self.stats["unpinned_bytes"] / GIB
            total = sum(a.nbytes for a in self.arenas.values()) / GIB
            message = (f"could not pin {left:.1f} of {total:.1f} GiB of experts in RAM ({self._failure}); "
                       f"copies of those to the GPU will be slower")
            self.warnings.append(message)
            log.warning(message)
