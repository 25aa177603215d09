"""Compile a C source shipped with this package into a shared library once, cached on disk.

The system C compiler builds it at first use (about a second); torch.utils.cpp_extension would
pull in the C++ toolchain, torch's headers and ninja for what is one plain C file. The library is
keyed by a hash of the source, the flags and the compiler's version, so an edit, a new compiler
or other flags give a new file, and it is built into a temporary file and renamed into place,
so two processes building at once both end with a complete library.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path


class BuildError(RuntimeError):
    """The library could not be built; the message is one line meant for users."""


def cache_root() -> Path:
    """engine.load.demo.cache_root's rule (kernels may not import engine). Without platformdirs (a bare
    benchmark machine) the folder it would pick on Linux."""
    if os.environ.get("MOEDESK_CACHE_DIR"):
        return Path(os.environ["MOEDESK_CACHE_DIR"])
    try:
        import platformdirs
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moedesk"
    return Path(platformdirs.user_cache_dir("moedesk"))


def missing_cpu_flags(needed: tuple[str, ...], what: str) -> str | None:
    """Why this CPU cannot run code built for the /proc/cpuinfo flags `needed` (`what` names them in the
    message, e.g. "AVX2"), or None when every core has them all."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU with {what} (this is {machine})"
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"cannot read /proc/cpuinfo to confirm {what}"
    common = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags = set(value.split())
            common = flags if common is None else common & flags
    missing = [f for f in needed if f not in (common or set())]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def build_name(lib) -> str:
    """A loaded library's file name, which names what it was built from (source, flags, compiler; build_library):
    start-up profiles key on it, so a profile timed with one build of a kernel is not reused with another."""
    return Path(lib._name).stem


def open_library(source: Path, flags: list[str], cpu_problem: str | None, supported: str, unsupported: str):
    """(the built library, None), or (None, one line saying why it cannot be used): the CPU (`cpu_problem`,
    from missing_cpu_flags), no compiler, a failed build or load, or the library's own `supported()` check
    (e.g. the OS not enabling the vector state), which `unsupported` explains."""
    if cpu_problem is not None:
        return None, cpu_problem
    if find_compiler() is None:
        return None, "no C compiler found (install gcc or set CC)"
    try:
        lib = ctypes.CDLL(str(build_library(source, flags)))
    except BuildError as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot load the built kernel: {e}"
    if not getattr(lib, supported)():
        return None, unsupported
    return lib, None


def find_compiler() -> list[str] | None:
    """The C compiler command: $CC if set (it may carry arguments, e.g. "ccache gcc"), else cc, gcc or clang."""
    cc = os.environ.get("CC")
    if cc:
        parts = shlex.split(cc)
        return parts if parts and shutil.which(parts[0]) else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _compiler_identity(compiler: list[str]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler[0]} --version failed: {e}") from None
    return done.stdout.strip() or done.stderr.strip()


def build_library(source: Path, flags: list[str], compiler: list[str] | None = None) -> Path:
    """Path of the shared library built from `source` with `flags`, building it if it is not cached yet."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found (install gcc or set CC)")
    text = Path(source).read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), " ".join(compiler).encode(),
                                     _compiler_identity(compiler).encode(), platform.machine().encode()]))
    folder = cache_root() / "kernels"
    target = folder / f"{Path(source).stem}-{key.hexdigest()[:16]}.so"
    if _verified(target):
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.stem}-", suffix=".so")
        os.close(fd)
    except OSError as e:
        raise BuildError(f"cannot write the kernel cache {folder} ({e}); set MOEDESK_CACHE_DIR") from None
    command = [*compiler, *flags, str(source), "-o", tmp]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError(f"running {compiler[0]} failed: {e}") from None
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        log = folder / f"{target.stem}.log"
        try:
            os.replace(_write_exclusive(folder, f".{target.stem}-", (shlex.join(command) + "\n\n" + done.stdout
                                                                       + done.stderr).encode()), log)
        except OSError:
            log = None
        lines = (done.stderr or done.stdout).splitlines()
        first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        where = f" (full log: {log})" if log else ""
        raise BuildError(f"compiling {Path(source).name} failed: {first.strip()}{where}")
    digest = _write_exclusive(folder, f".{target.stem}-", _sha256(Path(tmp)).encode())
    os.replace(digest, _digest_path(target))
    os.replace(tmp, target)
    return target


# The cache folder is not trusted: a library planted there (its constructor runs at load) or cut short (a SIGBUS
# when a page past its end is touched) is not loaded. Its hash, recorded when it was built, is checked first,
# and a library that does not match is built again.

def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(library: Path) -> bool:
    try:
        return library.is_file() and not library.is_symlink() and \
            _digest_path(library).read_text().strip() == _sha256(library)
    except (OSError, UnicodeDecodeError):
        return False


def _write_exclusive(folder: Path, prefix: str, data: bytes) -> str:
    """A new file of `data` under a random name in `folder` (created, never opened through a planted link)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp
