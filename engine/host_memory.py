"""The memory this process may still use: the RAM available, or less where a cgroup (a container, a systemd
slice, `docker run --memory`) limits it. psutil sees only the machine's RAM, so a model that fits the machine but
not the container was read until the kernel's OOM killer ended the process."""
from __future__ import annotations

from pathlib import Path

_V1_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
# Where the kernel shows the cgroup file system and this process's groups; read at each call, so a test can point
# them at a fake cgroup laid out as the kernel lays one out.
CGROUP_ROOT = Path("/sys/fs/cgroup")
OWN_CGROUPS = Path("/proc/self/cgroup")


def available_memory(root: Path | None = None, own: Path | None = None) -> int:
    """Bytes this process may still allocate: min(RAM available, room left under every cgroup limit above it)."""
    import psutil

    ram = psutil.virtual_memory().available
    room = cgroup_room(root or CGROUP_ROOT, _read(own or OWN_CGROUPS) or "")
    return ram if room is None else min(ram, room)


def cgroup_room(root: Path, membership: str) -> int | None:
    """Room left under the tightest memory limit of the cgroups named in `membership` (/proc/self/cgroup's text)
    and their ancestors, under the cgroup file system at `root`; None where no limit is set or readable."""
    rooms = []
    for line in membership.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: "0::/path"
            rooms += [_room(folder, "memory.max", "memory.current") for folder in _up(root, path)]
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            rooms += [_room(folder, "memory.limit_in_bytes", "memory.usage_in_bytes")
                      for folder in _up(root / "memory", path)]
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def _up(root: Path, path: str) -> list[Path]:
    """The cgroup's folder and its ancestors' up to `root` (a container often sees only its own, as "/")."""
    parts = [p for p in path.strip().strip("/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _room(folder: Path, limit_file: str, usage_file: str) -> int | None:
    limit, usage = _read(folder / limit_file), _read(folder / usage_file)
    if limit is None or limit in ("", "max"):
        return None
    try:
        limit_bytes = int(limit)
        used = int(usage) if usage else 0
    except ValueError:
        return None
    if limit_bytes >= _V1_UNLIMITED:
        return None
    return max(0, limit_bytes - used)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
