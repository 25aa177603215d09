"""Whether the machine was busy while a bench ran: the CPU time other processes took meanwhile (psutil), so that
a figure measured beside someone else's work says so instead of passing for this machine's speed."""
from __future__ import annotations

import time

import psutil

from moedesk.engine.cpu_share import cpu_seconds

# Other processes taking this share of all cores' time make the figures unreliable: on a 2-core machine, one busy
# neighbour at a fifth of a core.
BUSY_SHARE = 0.10


def others_share(system_busy_s: float, own_s: float, wall_s: float, cores: int) -> float:
    """The share of all cores' time over `wall_s` that was busy, not with this process."""
    if wall_s <= 0 or cores <= 0:
        return 0.0
    return min(1.0, max(0.0, system_busy_s - own_s) / (wall_s * cores))


def busy_warning(share: float, threshold: float = BUSY_SHARE) -> str | None:
    if share < threshold:
        return None
    return (f"warning: other processes took {share:.0%} of the CPU while this ran; the figures may be low and "
            f"spread wide: run it again on an idle machine")


class CpuLoad:
    """Started at construction; `others()` is the share of the CPU other processes took since."""

    def __init__(self):
        self._wall = time.perf_counter()
        self._system, self._own = cpu_seconds()  # a bench starts no worker processes: its own time is its threads'

    def others(self) -> float:
        system, own = cpu_seconds()
        return others_share(system - self._system, own - self._own, time.perf_counter() - self._wall,
                            psutil.cpu_count() or 1)
