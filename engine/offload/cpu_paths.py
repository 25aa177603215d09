"""Which path of the packed CPU kernel computes a prefill's experts: AMX-INT8 tiles where the machine has them and
the start-up profile found them faster at prefill loads, VNNI otherwise.

The kernel's path is one setting of the process (kernels.cpu_quant.set_path); AMX only takes experts with 8 or more
tokens, so decode is the same on both. The choice is made from measured calls (engine.offload.profiler
.profile_prefill_cpu), never assumed: AMX has not run on every CPU that has it, and a path that failed its check
against VNNI's results, or that the OS refuses, is never picked.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("moedesk")

# AMX must beat VNNI by this much over the measured prefill loads to be chosen: timings move by a few percent.
MIN_GAIN = 0.05


def choose_cpu_path(calls_ms: dict[str, dict[int, float]], default: str = "vnni") -> str:
    """The path whose calls took the least time summed over the token counts every measured path shares: `default`
    unless another beat it by MIN_GAIN; `default` where it was not measured or no count is shared."""
    if default not in calls_ms:
        return default
    shared = set(calls_ms[default]).intersection(*(set(v) for v in calls_ms.values()))
    if not shared:
        return default
    total = {path: sum(times[n] for n in shared) for path, times in calls_ms.items()}
    best = min(total, key=lambda p: (total[p], p != default))
    return best if total[best] <= (1 - MIN_GAIN) * total[default] else default


def forced_path() -> str | None:
    """MOEDESK_QUANT_PATH when the user set it: then the profile's choice is not applied."""
    return os.environ.get("MOEDESK_QUANT_PATH", "").strip().lower() or None


def apply_cpu_path(profile: dict, warnings: list[str] | None = None) -> str | None:
    """Put the packed kernel on the path the profile chose (its "cpu_path"), unless the user forced one; falls back
    to VNNI, with a warning, where this process cannot take it. Returns the path whose rates the latency model
    should read (None: the profile measured none)."""
    chosen = profile.get("cpu_path")
    if chosen is None:
        return None
    from moedesk.kernels import cpu_quant

    if chosen not in cpu_quant.PATHS:  # unpacked experts: one path, nothing to set
        return chosen
    if not cpu_quant.available():
        return None
    if forced_path() is not None:
        return cpu_quant.get_path()
    try:
        return cpu_quant.set_path(chosen)
    except ValueError as e:  # a cached profile from before an OS or BIOS change, say
        message = f"the CPU kernel path {chosen} the profile chose is not usable here ({e}); using vnni"
        log.warning(message)
        if warnings is not None:
            warnings.append(message)
        return cpu_quant.set_path("vnni" if cpu_quant.vnni_supported() else "avx2")
