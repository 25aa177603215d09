"""How many CPU threads a step may use: the cores that other programs leave free.

An OpenMP team (torch's CPU ops, llama.cpp's graph) waits at every barrier for its slowest thread. When another
program keeps a core busy, a team spanning every core often has a thread descheduled, and each of a decode step's
hundreds of barriers waits for it: on a 2-core machine beside one busy process the demo decoded at a third of its
speed, beside a test run at a thirtieth (docs/measurements.md, "Session 63"). A team that leaves those cores to
their programs does not wait so. The decode thread follows the machine between steps, once a second at most.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import psutil

INTERVAL_S = 1.0  # how often the machine is looked at: a program's use of a core is steady over seconds
FIRST_WINDOW_S = 0.1  # the first measure's, from the engine's start: the CPU counters tick a hundred times a second


def threads_for(most: int, cores: int, others_busy: float) -> int:
    """Threads for the next steps: at most `most`, on `cores` cores of which other programs keep `others_busy` busy
    (in cores; from half a core on, a core counts as taken)."""
    taken = int(others_busy + 0.5)
    return max(1, min(most, cores - taken))


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, summed over its CPUs; CPU seconds this process has run): what
    the share follows, and what bench.machine_load reports a bench ran beside."""
    t = psutil.cpu_times()
    busy = sum(getattr(t, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


def physical_cores() -> int:
    """Physical cores this process may run on (the unit thread counts are in)."""
    logical = psutil.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = logical
    return max(1, min(physical, allowed * physical // logical))


class CpuShare:
    """Sets the thread count of the steps that follow (`set_threads(n)`, on the decode thread) to what the CPUs
    other programs leave free allow, up to `most()` (the engine's own choice, read at the first step, after the load
    set it). `follow()` is called before each step. MOEDESK_FOLLOW_CPU=0 keeps the engine's count."""

    def __init__(self, set_threads: Callable[[int], None], most: Callable[[], int], cores: int | None = None,
                 interval_s: float = INTERVAL_S, clock=time.monotonic, sample=cpu_seconds, sleep=time.sleep):
        self.set_threads, self._most = set_threads, most
        self.cores = cores if cores is not None else physical_cores()
        self.per_cpu = self.cores / (psutil.cpu_count() or self.cores)  # a logical CPU's busy time, in cores
        self.interval_s, self.clock, self.sample, self.sleep = interval_s, clock, sample, sleep
        self.fixed = os.environ.get("MOEDESK_FOLLOW_CPU", "1").strip() == "0"
        self.most = self.threads = None  # the engine's count, and the one set (both known from the first step)
        self.others_busy = 0.0  # the latest measure, in cores
        self.start()

    def start(self) -> None:
        """Start the count (at the engine's start, not its first step: a first reply on a busy machine ran its
        prefill with every thread, each barrier waiting for the thread another program held)."""
        self._last = (self.clock(), *self.sample())
        self.measured = False

    def follow(self) -> None:
        if self.fixed:
            return
        if self.most is None:  # read at the first step, after the load set it
            self.most = self.threads = max(1, self._most())
        now = self.clock()
        if not self.measured and now - self._last[0] < FIRST_WINDOW_S:
            # The first step waits for a first measure (once, a tenth of a second at most): a batch's first step,
            # a whole prefill, came before it and ran with every thread, however busy the machine.
            self.sleep(FIRST_WINDOW_S - (now - self._last[0]))
            now = self.clock()
        elif now - self._last[0] < self.interval_s:
            return
        seconds = now - self._last[0]
        if seconds <= 0:  # a clock that did not move
            return
        busy, own = self.sample()
        last, self._last = self._last, (now, busy, own)
        self.measured = True
        self.others_busy = max(0.0, (busy - last[1]) - (own - last[2])) / seconds * self.per_cpu
        threads = threads_for(self.most, self.cores, self.others_busy)
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
