"""What this machine has: GPUs and their memory, RAM, CPU model, cores and vector/matrix ISA.

The placement needs the GPU's free memory and the RAM; the CPU expert kernels are chosen by
ISA (AVX512_BF16 and AMX decide whether 16-bit experts run at memory speed); and profiles are
cached per machine under `machine_fingerprint`. Parsing is kept in pure functions so that it
is tested on sample /proc/cpuinfo text instead of on whatever CPU runs the tests.
"""
from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")

# What torch's dispatch level implies when /proc/cpuinfo is not there (macOS, Windows).
_TORCH_CAPABILITY_FEATURES = {
    "AVX2": ("avx2",),
    "AVX512": ("avx2", "avx512f"),
}


@dataclass(frozen=True)
class CpuFeatures:
    """The ISA extensions that change which CPU expert kernel is fastest."""

    avx2: bool = False
    avx512f: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False

    def names(self) -> list[str]:
        return [name for name in CPU_FEATURES if getattr(self, name)]

    @classmethod
    def from_names(cls, names) -> CpuFeatures:
        names = set(names)
        return cls(**{name: name in names for name in CPU_FEATURES})


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class HardwareInfo:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    cpu_features: CpuFeatures
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    torch_cpu_capability: str = ""  # torch's own dispatch level, e.g. "AVX512"

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


def parse_cpu_flags(cpuinfo_text: str) -> CpuFeatures:
    """The features present on every processor listed in /proc/cpuinfo text.

    x86 lists them on `flags` lines, ARM on `Features` lines. Taking the intersection over
    processors means a kernel chosen from the result runs on whichever core the OS picks.
    Text without any such line gives no features.
    """
    common: set[str] | None = None
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags = set(value.split())
            common = flags if common is None else common & flags
    return CpuFeatures.from_names(common or ())


def parse_cpu_model(cpuinfo_text: str) -> str:
    """The first `model name` (x86) or `Model`/`Hardware` (ARM boards) in /proc/cpuinfo text, or ""."""
    found = {}
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        value = value.strip()
        # x86 also has a numeric `model` line (the family's model number): not a name.
        if sep and value and not value.isdigit() and key in ("model name", "model", "hardware", "cpu model"):
            found.setdefault(key, value)
    for key in ("model name", "cpu model", "model", "hardware"):
        if key in found:
            return found[key]
    return ""


def features_from_torch_capability(capability: str) -> CpuFeatures:
    """Best effort where /proc/cpuinfo is missing: torch only reports its dispatch level (AVX2, AVX512, ...)."""
    return CpuFeatures.from_names(_TORCH_CAPABILITY_FEATURES.get(capability.upper(), ()))


def _torch_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return ""


def cuda_device_count() -> int:
    """How many CUDA GPUs torch sees (0 without CUDA): what per-device budgets are checked against."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def thread_gpu(device) -> int | None:
    """The GPU index a thread running `device`'s model must make current, or None: nothing to set (the CPU, or plain
    "cuda", which is the current device). A new thread starts on GPU 0, and Triton launches on the current device."""
    device = torch.device(device)
    return device.index if device.type == "cuda" else None


def use_device(device) -> None:
    """Make `device` this thread's current GPU (thread_gpu): the loading thread and each thread that runs the model,
    so that one GPU named cuda:1 works outside a spread too (a spread's runs are under `on_device`)."""
    index = thread_gpu(device)
    if index is not None and torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


def on_device(device: torch.device):
    """Make `device` the current CUDA device while in the block (Triton launches on the current device, not on its
    tensors'); nothing for any other device. Several GPUs run layers and experts on each under it."""
    import contextlib

    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _detect_gpus() -> tuple[GpuInfo, ...]:
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuInfo(index=i, name=torch.cuda.get_device_name(i), total_bytes=int(total), free_bytes=int(free)))
    return tuple(gpus)


def detect_hardware(cpuinfo_path: str | Path = "/proc/cpuinfo") -> HardwareInfo:
    """Look at this machine. The only GPU call of the module, and only when CUDA is available."""
    capability = _torch_capability()
    try:
        cpuinfo = Path(cpuinfo_path).read_text(errors="replace")
    except OSError:
        cpuinfo = None  # not Linux (or a locked-down container): fall back on torch and platform
    if cpuinfo is not None:
        features, model = parse_cpu_flags(cpuinfo), parse_cpu_model(cpuinfo)
    else:
        features, model = features_from_torch_capability(capability), ""
    logical = psutil.cpu_count(logical=True) or 1
    memory = psutil.virtual_memory()
    return HardwareInfo(
        cpu_model=model or platform.processor() or platform.machine() or "unknown CPU",
        physical_cores=psutil.cpu_count(logical=False) or logical,
        logical_cores=logical,
        cpu_features=features,
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        gpus=_detect_gpus(),
        torch_cpu_capability=capability,
    )


def machine_fingerprint(info: HardwareInfo | None = None) -> str:
    """A short string that stays the same on this machine and changes when its hardware does.

    Made of what a latency profile depends on and that does not drift: CPU model, core count,
    GPU names and total memories. Free GPU memory and available RAM change from run to run and
    are left out; RAM is rounded to whole GiB because the kernel's reserve moves MemTotal a
    little between kernel versions.
    """
    info = info or detect_hardware()
    parts = [info.cpu_model, f"{info.physical_cores}c", f"{round(info.ram_total_bytes / 2**30)}GiB"]
    parts += [f"{gpu.name}:{gpu.total_bytes}" for gpu in info.gpus]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_hardware(info: HardwareInfo) -> str:
    """A few aligned lines for `moedesk profile` and the UI."""
    features = " ".join(name.upper() for name in info.cpu_features.names()) or "none of " + "/".join(
        name.upper() for name in CPU_FEATURES)
    rows = [
        ("CPU", f"{info.cpu_model}, {info.physical_cores} cores / {info.logical_cores} threads"),
        ("ISA", features + (f" (torch: {info.torch_cpu_capability})" if info.torch_cpu_capability else "")),
        ("RAM", f"{_gib(info.ram_total_bytes)} total, {_gib(info.ram_available_bytes)} available"),
    ]
    rows += [(f"GPU {gpu.index}", f"{gpu.name}, {_gib(gpu.total_bytes)} total, {_gib(gpu.free_bytes)} free")
             for gpu in info.gpus] or [("GPU", "no CUDA GPU (experts run on the CPU)")]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {text}" for label, text in rows)
