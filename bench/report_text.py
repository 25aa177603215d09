"""How bench reports read: numbers to three significant digits, tables whose columns never run together, the
profile as a sentence rather than raw measurement dicts."""
from __future__ import annotations

import math


def significant(x: float | None, digits: int = 3) -> str:
    """`x` to `digits` significant digits, without exponent notation: 15.7, 0.0123, 1870; '-' for None."""
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(x)))
    if decimals <= 0:
        return f"{round(x, decimals):.0f}"
    return f"{x:.{decimals}f}"


def text_table(header: list[str], rows: list[list[str]], left: int = 1, gap: int = 2) -> list[str]:
    """Lines of a table: the first `left` columns left-aligned, the rest right-aligned, each as wide as its widest
    cell and `gap` spaces apart, so that two numbers never touch however long they grow."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        return (" " * gap).join(str(c).ljust(w) if i < left else str(c).rjust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *(line(r) for r in rows)]


def by_tokens(points: dict) -> str:
    """{tokens: ms} as '1: 15.7 · 4: 164 ms'."""
    items = sorted(((int(n), ms) for n, ms in points.items()), key=lambda p: p[0])
    return " · ".join(f"{n}: {significant(ms)}" for n, ms in items) + " ms"


def profile_line(profile: dict) -> str:
    """The one-expert profile a bench measured, in words: one expert's time by tokens on the CPU and the GPU (or the
    GPU tier simulated on the CPU), the copy time and the bandwidths."""
    parts = [f"one expert on the CPU (tokens: time) {by_tokens(profile['cpu_expert_ms'])}"]
    if profile.get("gpu_expert_ms"):
        parts.append(f"on the GPU tier {by_tokens(profile['gpu_expert_ms'])}")
    parts.append(f"copy {significant(profile['copy_expert_ms'])} ms")
    parts.append(f"CPU read {significant(profile['cpu_read_gbs'])} GB/s, to the GPU "
                 f"{significant(profile['h2d_gbs'])} GB/s")
    return "profile: " + "; ".join(parts)
