"""Latency of one expert on the CPU and on the GPU, of copying it over PCIe, and of an activation round trip.

Fitted once per machine, model shape and dtype from the profiler's measurements (see
`engine.offload.profiler.profile_expert`) and cached as JSON; the per-step decisions in
`engine.offload.assignment` read it hundreds of times per token, so evaluating it is plain arithmetic.

The shapes follow what the hardware does (docs/measurements.md, "Facts measured on the GPU box"):

- CPU: a step's CPU experts are one kernel call, which costs a part of its own (waking the threads,
  quantising the activations, each phase's last items) and each expert's share: a weight read plus
  arithmetic. The profiler times calls of one expert and of several (`cpu_call_ms`); their difference
  is an expert's share, the rest the call's own cost, measured at a few tokens an expert and joined
  by straight lines. Timed alone, one expert's call overprices an expert of a larger call at every
  token count (docs/measurements.md). An expert's share can never take less than reading its
  bytes (the floor), and above that grows about linearly in tokens:
  cpu(n) = max(a + b·n, floor). The floor is the read time at the bandwidth measured, the
  lower of two: the machine's streaming read bandwidth, and the one the expert kernel itself
  reached in its fastest measured call (a bf16 kernel often reads well below the first, flat up to ~16
  tokens, which one line cannot follow). The first also corrects profiles taken with a small
  expert hot in the last-level cache, which a real step, streaming experts from DRAM, never
  sees.
- GPU: memory-bound and nearly constant up to hundreds of tokens, then compute-bound; the
  measured points are interpolated piecewise-linearly instead of forcing a formula on them.
- Copy: one expert's weights host-to-device, independent of tokens.
- Activation round trip: the tokens' hidden states to the CPU and the expert's output back.
- Contention: CPU experts and PCIe copies both read host memory, so while both run each is
  slower than alone; the profiler measures the two slowdown factors with both running, at a few
  token counts per CPU expert (a call that waits on RAM suffers more than one its arithmetic
  holds), and between those counts they are interpolated.
- Copy launch: the host thread queues each copy and its GPU compute before it joins the CPU
  experts, so every copy delays the CPU side by that much host time. Queued back to back for a prefill's
  tokens it costs more than the lone drained copy `copy_launch_ms` times (docs/measurements.md), so where
  the profile measured that (`copy_launch_at`), a step reads it at its experts' mean load, joined by a straight
  line to the lone copy's price at its two tokens.
- Prefill loads: from the first load measured (8 tokens) the CPU's share is read from calls of several experts at
  those loads on the kernel path the profile chose (`cpu_share`; engine.offload.cpu_paths), not from the line above,
  which one-expert calls set: one expert cannot give every thread work, so their slope overprices a prefill step's
  experts. Below it the line, capped at the first load's share.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import asdict, dataclass

import numpy as np

from moedesk.engine.errors import MoedeskError

FORMAT_VERSION = 2
LONE_COPY_TOKENS = 2  # the tokens of the copy `copy_launch_ms` times (engine.offload.profiler.copy_launch_ms)


class ProfileError(MoedeskError):
    """Measurements (or a cached model) that a latency model cannot be built from."""


@dataclass(frozen=True)
class LatencyModel:
    """Milliseconds for one expert of one model on this machine; see the module docstring for the shapes."""

    cpu_intercept_ms: float  # a in max(a + b·n, floor)
    cpu_per_token_ms: float  # b
    cpu_floor_ms: float  # expert bytes at the measured read bandwidth (module docstring)
    gpu_tokens: tuple[float, ...]  # measured token counts, increasing
    gpu_ms: tuple[float, ...]  # GPU time at those counts, made non-decreasing
    copy_expert_ms: float  # host-to-device copy of one expert's weights (pinned)
    roundtrip_base_ms: float = 0.0
    roundtrip_per_token_ms: float = 0.0
    expert_bytes: int = 0
    # ((CPU tokens an expert, CPU expert time while copies run over its time alone, copy time while CPU experts
    # run over its time alone), ...) by increasing tokens; empty: no contention measured (factors 1).
    contention: tuple[tuple[float, float, float], ...] = ()
    copy_launch_ms: float = 0.0  # host time to queue one expert's copy and GPU compute (the CPU side pays it)
    resident_launch_ms: float = 0.0  # host time to queue a layer step's resident experts on the GPU
    # A decode layer of one token, g of its zero_copy_top_k experts read from RAM by the GPU and the rest on the
    # CPU: ms until both are done, indexed by g (engine.offload.profiler.profile_zero_copy; empty: not measured).
    zero_copy_split_ms: tuple[float, ...] = ()
    zero_copy_top_k: int = 0
    # The same layer with every expert's intermediate rows split instead: the GPU reads the last r rows of
    # each from RAM while the CPU computes the others; ((r, ms), ...) by increasing r (empty: not measured).
    split_width_ms: tuple[tuple[int, float], ...] = ()
    # A CPU call's own cost, beyond its experts' shares: ((tokens an expert, ms), ...) by increasing tokens
    # (empty: not measured, and cpu_expert_ms is a call of one expert).
    cpu_call: tuple[tuple[float, float], ...] = ()
    # An expert's share of a CPU call at prefill loads: ((tokens an expert, ms), ...) by increasing tokens, from calls
    # of several experts on the chosen kernel path (empty: not measured; the line above prices every load).
    cpu_share: tuple[tuple[float, float], ...] = ()
    # Host time to queue one copy and its GPU compute back to back, ((tokens, ms), ...) (empty: copy_launch_ms).
    copy_launch_by_tokens: tuple[tuple[float, float], ...] = ()
    # Host time to queue one expert's copy alone, back to back with others (a prefill's grouped copies compute in one
    # launch a copy run: engine.offload.assignment.copy_runs); 0: not measured (the link alone paces them).
    copy_queue_ms: float = 0.0

    def __post_init__(self):
        # Tuples, so that a model read back from JSON compares equal and stays hashable.
        object.__setattr__(self, "gpu_tokens", tuple(float(x) for x in self.gpu_tokens))
        object.__setattr__(self, "gpu_ms", tuple(float(x) for x in self.gpu_ms))
        object.__setattr__(self, "zero_copy_split_ms", tuple(float(x) for x in self.zero_copy_split_ms))
        object.__setattr__(self, "split_width_ms", tuple((int(r), float(ms)) for r, ms in self.split_width_ms))
        object.__setattr__(self, "contention", tuple(tuple(float(x) for x in point) for point in self.contention))
        object.__setattr__(self, "cpu_call", tuple((float(n), float(ms)) for n, ms in self.cpu_call))
        object.__setattr__(self, "cpu_share", tuple((float(n), float(ms)) for n, ms in self.cpu_share))
        object.__setattr__(self, "copy_launch_by_tokens",
                           tuple((float(n), float(ms)) for n, ms in self.copy_launch_by_tokens))
        scalars = (self.cpu_intercept_ms, self.cpu_per_token_ms, self.cpu_floor_ms, self.copy_expert_ms,
                   self.roundtrip_base_ms, self.roundtrip_per_token_ms, self.copy_launch_ms, self.resident_launch_ms,
                   self.copy_queue_ms)
        split_width = tuple(x for pair in self.split_width_ms for x in pair)
        call = tuple(x for pairs in (self.cpu_call, self.cpu_share, self.copy_launch_by_tokens)
                     for pair in pairs for x in pair)
        if not all(math.isfinite(x) and x >= 0
                   for x in scalars + self.gpu_tokens + self.gpu_ms + self.zero_copy_split_ms + split_width + call):
            raise ProfileError("latency model: every time and count must be finite and >= 0")
        for name in ("cpu_share", "copy_launch_by_tokens"):
            points = getattr(self, name)
            if any(n < 1 for n, _ in points) or any(b[0] <= a[0] for a, b in zip(points, points[1:])):
                raise ProfileError(f"latency model: {name} token counts must be >= 1 and strictly increasing")
        if any(len(point) != 3 for point in self.contention):
            raise ProfileError("latency model: contention points must be (tokens, CPU slowdown, copy slowdown)")
        if not all(math.isfinite(x) and x >= 1 for point in self.contention for x in point):
            raise ProfileError("latency model: contention token counts and slowdown factors must be finite and >= 1")
        if any(b[0] <= a[0] for a, b in zip(self.contention, self.contention[1:])):
            raise ProfileError("latency model: contention token counts must be strictly increasing")
        if any(b[0] <= a[0] for a, b in zip(self.cpu_call, self.cpu_call[1:])):
            raise ProfileError("latency model: CPU call token counts must be strictly increasing")
        if not self.gpu_tokens or len(self.gpu_tokens) != len(self.gpu_ms):
            raise ProfileError("latency model: GPU needs at least one (tokens, ms) point")
        if any(b <= a for a, b in zip(self.gpu_tokens, self.gpu_tokens[1:])):
            raise ProfileError("latency model: GPU token counts must be strictly increasing")

    def cpu_expert_ms(self, tokens: int) -> float:
        """One expert's share of a CPU call on the whole pool, `tokens` tokens (0 tokens: nothing to run)."""
        if tokens <= 0:
            return 0.0
        if self.cpu_share and tokens >= self.cpu_share[0][0]:  # prefill loads (held to the read time at the fit)
            return _extended_line(self.cpu_share, tokens)
        line = max(self.cpu_intercept_ms + self.cpu_per_token_ms * tokens, self.cpu_floor_ms)
        # Fewer tokens never cost more than the first prefill load's share (decode's few tokens stay under it).
        return min(line, self.cpu_share[0][1]) if self.cpu_share else line

    def cpu_call_ms(self, tokens: float) -> float:
        """A CPU call's own cost when its experts have about `tokens` tokens each: the measured points joined
        by straight lines, held at the end points' values beyond them (0 where not measured)."""
        return _held_line(self.cpu_call, tokens) if self.cpu_call else 0.0

    def cpu_alone_ms(self, tokens: int) -> float:
        """A CPU call of one expert with `tokens` tokens: its share and the call's own cost."""
        return self.cpu_call_ms(tokens) + self.cpu_expert_ms(tokens) if tokens > 0 else 0.0

    def gpu_expert_ms(self, tokens: int) -> float:
        """One expert already in GPU memory: measured points joined by straight lines.

        Below the first point it stays at the first point's time (a memory-bound kernel does
        not get faster with fewer rows); past the last it continues the last segment's slope.
        """
        if tokens <= 0:
            return 0.0
        xs, ys = self.gpu_tokens, self.gpu_ms
        if tokens <= xs[0]:
            return ys[0]
        i = bisect_right(xs, tokens)
        if i == len(xs):
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + slope * (tokens - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def copy_launch_at(self, tokens: float) -> float:
        """Host time to queue one copy and its GPU compute in a step whose experts have about `tokens` tokens each:
        the back-to-back measurements joined by straight lines and held beyond them, else `copy_launch_ms`."""
        points = self.copy_launch_by_tokens
        if not points:
            return self.copy_launch_ms
        if points[0][0] > LONE_COPY_TOKENS:  # from the lone drained copy's load up to the first measured
            points = ((LONE_COPY_TOKENS, self.copy_launch_ms),) + points
        return _held_line(points, tokens)

    def slowdowns(self, tokens: float) -> tuple[float, float]:
        """(CPU, copy) slowdown factors while CPU experts of `tokens` tokens each and copies run at the same time:
        the measured points joined by straight lines, held at the end points' values beyond them."""
        points = self.contention
        if not points:
            return 1.0, 1.0
        return (_held_line([(n, cpu) for n, cpu, _ in points], tokens),
                _held_line([(n, copy) for n, _, copy in points], tokens))

    def activation_roundtrip_ms(self, tokens: int) -> float:
        """Hidden states of `tokens` tokens GPU→CPU and the expert's output back."""
        if tokens <= 0:
            return 0.0
        return self.roundtrip_base_ms + self.roundtrip_per_token_ms * tokens

    def to_dict(self) -> dict:
        """JSON-ready; `from_dict` reads it back."""
        d = asdict(self)
        d["gpu_tokens"], d["gpu_ms"] = list(self.gpu_tokens), list(self.gpu_ms)
        return {"version": FORMAT_VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyModel:
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
            raise ProfileError(f"latency model: expected format version {FORMAT_VERSION}, "
                               f"got {d.get('version') if isinstance(d, dict) else type(d).__name__}")
        fields = {k: v for k, v in d.items() if k != "version"}
        try:
            return cls(**fields)
        except TypeError as e:  # a missing or unknown field
            raise ProfileError(f"latency model: {e}") from None


def _held_line(points, x: float) -> float:
    """The (x, y) points, x increasing, joined by straight lines and held at the end points' y beyond them."""
    i = bisect_right([p[0] for p in points], x)
    if i == 0 or i == len(points):
        return points[min(i, len(points) - 1)][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _extended_line(points, x: float) -> float:
    """The (x, y) points joined by straight lines, continued past the last along the last segment's slope (work
    keeps growing with tokens) and held below the first."""
    if x >= points[-1][0] and len(points) > 1:
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)
    return _held_line(points, x)


def _points(profile: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, ms) sorted by tokens; JSON turns the token keys into strings, so both are accepted."""
    raw = profile.get(key)
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(f"profile: '{key}' needs at least one {{tokens: ms}} point")
    try:
        pairs = sorted((int(n), float(ms)) for n, ms in raw.items())
    except (TypeError, ValueError):
        raise ProfileError(f"profile: '{key}' must map token counts to milliseconds") from None
    n, y = (np.array(v, dtype=float) for v in zip(*pairs))
    if np.any(n <= 0) or np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ProfileError(f"profile: '{key}' needs token counts >= 1 and times > 0")
    return n, y


def _relative_affine(n: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """a, b >= 0 minimising Σ((a + b·n - y) / y)²: relative error, so 1-token times count as much as 256-token ones.

    Decode lives at a few tokens per expert; an absolute fit would be ruled by the largest,
    slowest points and get exactly the decode region wrong.
    """
    w = 1.0 / y
    (a, b), *_ = np.linalg.lstsq(np.column_stack([w, n * w]), np.ones_like(y), rcond=None)
    if b < 0:  # noise on a flat curve: more tokens never take less time
        return float(np.sum(w) / np.sum(w * w)), 0.0
    if a < 0:  # a line through the large-n points only; keep small-n predictions positive
        return 0.0, float(np.sum(n * w) / np.sum((n * w) ** 2))
    return float(a), float(b)


def fit_cpu(n: np.ndarray, y: np.ndarray, floor_ms: float) -> tuple[float, float]:
    """a, b of cpu(n) = max(a + b·n, floor_ms), least squares in relative error.

    Points the floor explains carry no information about the line, so the line is fitted to
    each suffix of the points sorted by tokens (the points above the floor are always a
    suffix, the line being non-decreasing) and the suffix whose max(line, floor) explains all
    points best wins; ties go to the longer suffix.
    """
    order = np.argsort(n)
    n, y = n[order], y[order]
    if len(n) == 1:
        return float(y[0]), 0.0
    best = None
    for start in range(len(n) - 1):
        a, b = _relative_affine(n[start:], y[start:])
        err = float(np.sum(((np.maximum(a + b * n, floor_ms) - y) / y) ** 2))
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, a, b)
    return best[1], best[2]


def _roundtrip(profile: dict) -> tuple[float, float]:
    """(base, per token): a dict of points gets an affine fit; the profiler's single 1-token number a constant."""
    raw = profile.get("activation_roundtrip_ms", 0.0)
    if isinstance(raw, dict):
        n, y = _points(profile, "activation_roundtrip_ms")
        if len(n) == 1:
            return float(y[0]), 0.0
        b, a = np.polyfit(n, y, 1)
        return (float(a), float(b)) if a >= 0 and b >= 0 else (float(np.mean(y)), 0.0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ProfileError("profile: 'activation_roundtrip_ms' must be a number or {tokens: ms}") from None
    return value, 0.0


def fit_latency_model(profile_points: dict, cpu_path: str | None = None, prefill_rates: bool = True) -> LatencyModel:
    """Build the model from the profiler's raw measurements.

    Keys read: cpu_expert_ms {tokens: ms}, gpu_expert_ms {tokens: ms}, copy_expert_ms (ms),
    expert_bytes, cpu_read_gbs (GB/s, for the CPU floor; missing → the kernel's fastest call
    alone sets it) and optionally
    activation_roundtrip_ms (ms at one token, or {tokens: ms}; missing → 0, Fiddler found
    activation copies under 1% of the time), cpu_slowdown_during_copy and copy_slowdown_during_cpu
    (each a factor or {tokens: factor}; missing → 1), copy_launch_ms and resident_launch_ms (missing → 0),
    zero_copy_split_ms {g: ms} for g = 0, 1, ... with zero_copy_top_k, and split_width_ms {rows: ms} (missing →
    not measured); cpu_prefill_ms {path: {tokens: ms}} with cpu_prefill_experts (calls of that many experts at
    prefill loads on each kernel path; the shares are read on `cpu_path`, default the profile's own "cpu_path") and
    copy_launch_prefill_ms {tokens: ms} (missing, or prefill_rates False → the model prices prefill as before
    they were measured); copy_queue_prefill_ms (ms, a copy queued alone back to back; missing → 0). Other keys are
    ignored.
    """
    if not isinstance(profile_points, dict):
        raise ProfileError("profile: expected a dict of measurements")
    expert_bytes = int(profile_points.get("expert_bytes") or 0)
    read_gbs = float(profile_points.get("cpu_read_gbs") or 0.0)
    dram_floor_ms = expert_bytes / (read_gbs * 1e6) if expert_bytes > 0 and read_gbs > 0 else 0.0
    cpu_n, cpu_y = _points(profile_points, "cpu_expert_ms")
    # More tokens are more work, so a count cannot take longer than a larger one: a spike at few
    # tokens (the first point measured often is one) is noise, capped by the larger counts' times.
    cpu_y = np.minimum.accumulate(cpu_y[::-1])[::-1]
    cpu_y, cpu_call = _cpu_shares(profile_points, cpu_n, cpu_y, dram_floor_ms)
    # Bytes at the lower of the two bandwidths (module docstring): the kernel's own fastest
    # share when it never reached the machine's read bandwidth, else the DRAM read time.
    floor_ms = max(dram_floor_ms, float(cpu_y.min()))
    a, b = fit_cpu(cpu_n, cpu_y, floor_ms)
    gpu_n, gpu_y = _points(profile_points, "gpu_expert_ms")
    # Running maximum: a noisy dip would make the GPU look cheaper with more tokens.
    gpu_y = np.maximum.accumulate(gpu_y)
    if "copy_expert_ms" not in profile_points:
        raise ProfileError("profile: 'copy_expert_ms' is missing")
    base, per_token = _roundtrip(profile_points)
    return LatencyModel(
        cpu_intercept_ms=a, cpu_per_token_ms=b, cpu_floor_ms=floor_ms,
        gpu_tokens=tuple(gpu_n), gpu_ms=tuple(gpu_y), copy_expert_ms=float(profile_points["copy_expert_ms"]),
        roundtrip_base_ms=base, roundtrip_per_token_ms=per_token, expert_bytes=expert_bytes,
        contention=_contention(profile_points),
        copy_launch_ms=_milliseconds(profile_points, "copy_launch_ms"),
        resident_launch_ms=_milliseconds(profile_points, "resident_launch_ms"),
        zero_copy_split_ms=_zero_copy_split(profile_points),
        zero_copy_top_k=int(profile_points.get("zero_copy_top_k") or 0),
        split_width_ms=_split_width(profile_points),
        cpu_call=cpu_call,
        cpu_share=prefill_shares(profile_points, cpu_path, dram_floor_ms) if prefill_rates else (),
        copy_launch_by_tokens=_copy_launches(profile_points) if prefill_rates else (),
        copy_queue_ms=_milliseconds(profile_points, "copy_queue_prefill_ms"),
    )


def prefill_shares(profile: dict, path: str | None = None, floor_ms: float = 0.0) -> tuple[tuple[int, float], ...]:
    """An expert's share of a prefill step's CPU call at each measured load, on kernel `path` (default: the one the
    profile chose, its "cpu_path"): a call of `cpu_prefill_experts` experts over their number, kept non-decreasing
    in tokens and at least `floor_ms` (reading the expert's bytes from RAM). () where the profile has no such calls
    on that path."""
    by_path = profile.get("cpu_prefill_ms") or {}
    if not isinstance(by_path, dict):
        raise ProfileError("profile: 'cpu_prefill_ms' must map kernel paths to {tokens: ms}")
    path = path or profile.get("cpu_path")
    if path not in by_path:
        return ()
    experts = int(profile.get("cpu_prefill_experts") or 0)
    if experts < 1:
        raise ProfileError("profile: 'cpu_prefill_ms' needs 'cpu_prefill_experts' >= 1")
    key = f"cpu_prefill_ms[{path}]"
    n, y = _points({key: by_path[path]}, key)
    y = np.maximum.accumulate(np.maximum(y / experts, floor_ms))  # more tokens are never less work
    return tuple((int(a), float(b)) for a, b in zip(n, y))


def _copy_launches(profile: dict) -> tuple[tuple[int, float], ...]:
    if not profile.get("copy_launch_prefill_ms"):
        return ()
    n, y = _points(profile, "copy_launch_prefill_ms")
    return tuple((int(a), float(b)) for a, b in zip(n, y))


def _cpu_shares(profile: dict, n: np.ndarray, alone: np.ndarray, floor_ms: float):
    """(each expert's share of a call at the token counts n, ((tokens, the call's own cost), ...)) from the
    one-expert calls `alone` and the profile's calls of `cpu_call_experts` experts (module docstring). A share is
    the calls' difference per added expert, kept between reading the expert's bytes (floor_ms) and the whole
    one-expert call; past the last count measured in calls of several, the call's own cost is held. Without such
    calls: the one-expert calls, and no cost of their own."""
    experts = int(profile.get("cpu_call_experts") or 0)
    if "cpu_call_ms" not in profile or experts < 2:
        return alone, ()
    call_n, call_y = _points(profile, "cpu_call_ms")
    at = {int(k): float(ms) for k, ms in zip(n, alone)}
    own = []
    for k, ms in zip(call_n.astype(int), call_y):
        if k in at:
            share = min(max((ms - at[k]) / (experts - 1), floor_ms), at[k])
            own.append((k, at[k] - share))
    if not own:
        raise ProfileError("profile: 'cpu_call_ms' has no token count that 'cpu_expert_ms' has")
    shares = np.array([at[int(k)] - _held_line(own, k) for k in n])
    return np.maximum(shares, np.minimum(floor_ms, alone)), tuple(own)


def _split_width(profile: dict) -> tuple[tuple[int, float], ...]:
    """split_width_ms as ((rows, ms), ...) by increasing rows, each a positive count."""
    try:
        pairs = sorted((int(r), float(ms)) for r, ms in (profile.get("split_width_ms") or {}).items())
    except (AttributeError, TypeError, ValueError):
        raise ProfileError("profile: 'split_width_ms' must map row counts to times") from None
    if any(r <= 0 for r, _ in pairs):
        raise ProfileError("profile: 'split_width_ms' row counts must be positive")
    return tuple(pairs)


def _zero_copy_split(profile: dict) -> tuple[float, ...]:
    """zero_copy_split_ms as a tuple indexed by the experts read zero-copy; its keys must run 0, 1, ..."""
    split = profile.get("zero_copy_split_ms") or {}
    try:
        by_count = {int(g): float(ms) for g, ms in split.items()}
    except (AttributeError, TypeError, ValueError):
        raise ProfileError("profile: 'zero_copy_split_ms' must map expert counts to times") from None
    if sorted(by_count) != list(range(len(by_count))):
        raise ProfileError("profile: 'zero_copy_split_ms' must have the counts 0, 1, 2, ...")
    return tuple(by_count[g] for g in range(len(by_count)))


def _milliseconds(profile: dict, key: str) -> float:
    """An optional time; missing (older profiles, the simulated tier) → 0."""
    return _optional_number(profile, key, 0.0, "a time >= 0", lambda v: v >= 0)


def _contention(profile: dict) -> tuple[tuple[int, float, float], ...]:
    """The two slowdown factors as ((tokens, CPU, copy), ...): each measured {tokens: factor}, or one factor for every
    token count (older profiles); missing → 1, noise below 1 → 1. () when neither was measured."""
    cpu, copy = (_factors(profile, key) for key in ("cpu_slowdown_during_copy", "copy_slowdown_during_cpu"))
    if cpu is None and copy is None:
        return ()
    by_tokens = [f for f in (cpu, copy) if isinstance(f, dict)]
    tokens = sorted(by_tokens[0]) if by_tokens else [1]
    if any(sorted(f) != tokens for f in by_tokens):
        raise ProfileError("profile: the two slowdown factors must be measured at the same token counts")

    def at(factors, n: int) -> float:
        value = 1.0 if factors is None else factors[n] if isinstance(factors, dict) else factors
        return max(1.0, value)

    return tuple((n, at(cpu, n), at(copy, n)) for n in tokens)


def _factors(profile: dict, key: str) -> float | dict[int, float] | None:
    raw = profile.get(key)
    if raw is None:
        return None
    try:
        factors = {int(n): float(v) for n, v in raw.items()} if isinstance(raw, dict) else float(raw)
    except (AttributeError, TypeError, ValueError):
        raise ProfileError(f"profile: '{key}' must be a number or {{tokens: factor}}") from None
    values = list(factors.values()) if isinstance(factors, dict) else [factors]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ProfileError(f"profile: '{key}' must be positive numbers")
    if isinstance(factors, dict) and min(factors) < 1:
        raise ProfileError(f"profile: '{key}' token counts must be >= 1")
    return factors


def _optional_number(profile: dict, key: str, default: float, what: str, valid) -> float:
    try:
        value = float(profile.get(key, default))
    except (TypeError, ValueError):
        raise ProfileError(f"profile: '{key}' must be a number") from None
    if not math.isfinite(value) or not valid(value):
        raise ProfileError(f"profile: '{key}' must be {what}")
    return value
