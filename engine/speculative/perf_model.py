"""When does speculative decoding pay on a Mixture-of-Experts target, and with how many drafts?

The idea (the MoESD model of Huang et al.). Decoding one token per sequence at batch B reads the
weights of every expert the B tokens route to. Verifying γ draft tokens runs γ+1 tokens per
sequence through the target at once, B·(γ+1) tokens in all. With E experts and top-K routing
(ρ = K/E) and tokens that route independently, t tokens activate on average

    N(t) = E · (1 - (1-ρ)^t)        distinct experts per layer, each getting
    T_exp(t) = ρ·t / (1 - (1-ρ)^t)  tokens (N·T_exp = K·t: every token-expert pair counted once).

When experts are read from memory faster than they compute (an expert in RAM computed by the CPU,
or copied over PCIe), a step costs about what it reads: N(t) experts. At batch 1 the extra tokens
of a verify step activate extra experts (8 Mixtral experts, top-2: 1 token reads 2, 5 tokens read
about 6.1), so verification costs several plain steps and speculation loses unless almost every
draft is accepted. Once a batch already activates every expert, the extra tokens add compute but
no reads, and verification is nearly free: that is where speculation multiplies throughput.

The model of a target forward over t tokens is

    T(t) = bias + k1·G(t) + k2·N(t) + k3·G(T_exp(t))

with the roofline curve G(t; λ, s) = s^t below the knee λ·RP and the tangent line after it,
s^(λRP)·(1 + ln(s)·(t - λRP)): flat-ish while memory bound, linear once compute bound. RP is the
hardware's ridge point in tokens (given, not fitted); λ in [0.2, 1] and s in [1, 2] are fitted
with bias and k1..k3 by `scipy.optimize.least_squares` (trust-region reflective, those bounds and
every time coefficient ≥ 0). The draft costs draft_bias + draft_k·G(B) per drafted token, checking
the drafts reject_bias + reject_k·B. With acceptance α (the chance that a draft token is accepted,
independently of the others) a verify step yields on average

    σ(α, γ)·(γ+1) = (1 - α^(γ+1)) / (1 - α)    tokens per sequence,

so the speedup over plain decoding is

    σ·(γ+1)·T(B) / (γ·T_draft(B) + T(B·(γ+1)) + T_reject(B)).

Departure from the paper's Algorithm 1: it counts a verify step as B·γ tokens; here it is B·(γ+1),
because the target also runs the last accepted token, whose output checks the first draft — that
is what the engine measures as "k tokens at once" (k = γ+1), and what the tests' figures are.

The decision (`choose_draft_length`) picks the γ with the best predicted speedup and keeps it only
if that speedup is at least 1 + `SAFETY_MARGIN`; otherwise γ = 0, plain decoding. The costs come
either from a fitted model (`ModelCosts`, which can extrapolate to batches never measured) or from
a table of measured step times T(B, k) (`MeasuredCosts`, which never extrapolates: a γ whose verify
step lies outside the table is not considered).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

# Speculate only where the predicted speedup is at least 10%. Why that much: step times of one
# machine of the GPU box moved by more than 10% between runs (docs/measurements.md, "Where a Qwen3 step
# goes"), the acceptance α is estimated from past steps, and a
# fitted model is off by a few percent at the points it was fitted to (more where it extrapolates).
# Below this margin a mistaken "speculate" costs more than a missed one gains.
SAFETY_MARGIN = 0.10

LAMBDA_BOUNDS = (0.2, 1.0)
S_BOUNDS = (1.0, 2.0)


# --- the closed forms -------------------------------------------------------------------------

def activated_experts(tokens, experts: int, top_k: int):
    """N(t): expected distinct experts per layer that t independently routed tokens activate."""
    rho = top_k / experts
    t = np.asarray(tokens, dtype=float)
    return experts * (1.0 - (1.0 - rho) ** t)


def tokens_per_expert(tokens, experts: int, top_k: int):
    """T_exp(t): expected tokens each activated expert gets; 1 at t = 1, ρ·t for large t."""
    rho = top_k / experts
    t = np.asarray(tokens, dtype=float)
    if rho >= 1.0:  # dense: one expert sees every token
        return t.copy()
    # At t = 0 the ratio is 0/0; its limit is ρ / -ln(1-ρ) (what a vanishing load would see).
    limit0 = rho / -math.log1p(-rho)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = rho * t / (1.0 - (1.0 - rho) ** t)
    return np.where(t == 0, limit0, value)


def roofline(t, lam: float, s: float, ridge: float):
    """G(t; λ·RP, s): s^t up to the knee λ·RP, then the line tangent to it there."""
    t = np.asarray(t, dtype=float)
    knee = lam * ridge
    at_knee = s ** knee
    below = s ** np.minimum(t, knee)
    above = at_knee * (1.0 + math.log(s) * (t - knee))
    return np.where(t <= knee, below, above)


def tokens_per_step(alpha: float, gamma: int) -> float:
    """σ(α, γ)·(γ+1): expected tokens one verify step yields (accepted drafts + the target's own)."""
    if gamma < 0:
        raise ValueError("gamma must be >= 0")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def sigma(alpha: float, gamma: int) -> float:
    """σ(α, γ) = (1 - α^(γ+1)) / ((1 - α)(γ + 1)): the fraction of the γ+1 slots that yield a token."""
    return tokens_per_step(alpha, gamma) / (gamma + 1)


def acceptance_from_tokens_per_step(mean_tokens: float, gamma: int) -> float:
    """The α whose expected tokens per step at draft length γ equal the measured mean (inverse of
    `tokens_per_step`, which rises with α), clipped to [0, 1]."""
    if gamma < 1:
        raise ValueError("gamma must be >= 1 to measure acceptance")
    if mean_tokens <= 1.0:
        return 0.0
    if mean_tokens >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tokens_per_step(mid, gamma) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- the model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedupModel:
    """The ten fitted parameters (times in ms) and the shape they were fitted for."""
    experts: int
    top_k: int
    ridge: float  # the ridge point RP in tokens: where the hardware turns compute bound
    bias: float
    k1: float
    k2: float
    k3: float
    lam: float
    s: float
    draft_bias: float = 0.0
    draft_k: float = 0.0
    reject_bias: float = 0.0
    reject_k: float = 0.0


def _target_terms(tokens, experts, top_k, lam, s, ridge):
    """The four columns the target time is a non-negative combination of: 1, G(t), N(t), G(T_exp(t))."""
    t = np.asarray(tokens, dtype=float)
    return np.stack([np.ones_like(t), roofline(t, lam, s, ridge), activated_experts(t, experts, top_k),
                     roofline(tokens_per_expert(t, experts, top_k), lam, s, ridge)], axis=-1)


def target_time(m: SpeedupModel, tokens):
    """T(t): one target forward over t tokens in all (B sequences × k tokens each), in ms."""
    terms = _target_terms(tokens, m.experts, m.top_k, m.lam, m.s, m.ridge)
    return terms @ np.array([m.bias, m.k1, m.k2, m.k3])


def ar_time(m: SpeedupModel, batch: int) -> float:
    return float(target_time(m, batch))


def verify_time(m: SpeedupModel, batch: int, gamma: int) -> float:
    return float(target_time(m, batch * (gamma + 1)))


def draft_time(m: SpeedupModel, batch: int) -> float:
    """One draft token for each of the B sequences."""
    return float(m.draft_bias + m.draft_k * roofline(batch, m.lam, m.s, m.ridge))


def reject_time(m: SpeedupModel, batch: int) -> float:
    return m.reject_bias + m.reject_k * batch


def target_efficiency(m: SpeedupModel, batch: int, gamma: int) -> float:
    """T(B, 1) / T(B, γ+1): what the hardware gives speculation, whatever the draft's accuracy."""
    return ar_time(m, batch) / verify_time(m, batch, gamma)


def speedup(m: SpeedupModel, batch: int, gamma: int, alpha: float) -> float:
    return predicted_speedup(ModelCosts(m), batch, gamma, alpha)


# --- fitting ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepTime:
    """One measured target forward: `batch` sequences with `tokens` tokens each, `ms` long."""
    batch: int
    tokens: int
    ms: float


@dataclass(frozen=True)
class FitResult:
    model: SpeedupModel
    rms_relative_error: float  # over the target points, e.g. 0.03 = 3%
    max_relative_error: float


def _start_points(t, y, experts, top_k, ridge, count):
    # For fixed (λ, s) the target time is linear in (bias, k1, k2, k3) ≥ 0, so a non-negative least
    # squares solve gives each start of the nonlinear fit its best coefficients; the nonlinear
    # solver is local, so it starts from the `count` best of a grid of (λ, s).
    from scipy.optimize import nnls  # the fits import scipy.optimize where they run: most starts never fit

    starts = []
    for lam in np.linspace(*LAMBDA_BOUNDS, 5):
        for s in (1.001, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0):
            a = _target_terms(t, experts, top_k, lam, s, ridge) / y[:, None]
            coef, misfit = nnls(a, np.ones_like(y))
            starts.append((misfit, np.concatenate([coef, [lam, s]])))
    starts.sort(key=lambda start: start[0])
    return [x for _, x in starts[:count]]


def fit_target_times(points: Sequence[StepTime], experts: int, top_k: int, ridge: float,
                     lower: Mapping[str, float] | None = None) -> FitResult:
    """Fit bias, k1, k2, k3, λ, s to measured target step times by relative least squares.

    `lower` raises the lower bound of a time coefficient above 0 where its theoretical minimum is
    known (e.g. k2 ≥ the time to read one layer's expert at the measured bandwidth).
    """
    from scipy.optimize import least_squares

    if len(points) < 6:
        raise ValueError(f"need at least 6 measured steps to fit 6 parameters, got {len(points)}")
    t = np.array([p.batch * p.tokens for p in points], dtype=float)
    y = np.array([p.ms for p in points], dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured times must be positive")
    names = ("bias", "k1", "k2", "k3")
    lo = np.array([(lower or {}).get(n, 0.0) for n in names] + [LAMBDA_BOUNDS[0], S_BOUNDS[0]])
    hi = np.array([np.inf] * 4 + [LAMBDA_BOUNDS[1], S_BOUNDS[1]])

    def residuals(x):
        terms = _target_terms(t, experts, top_k, x[4], x[5], ridge)
        return terms @ x[:4] / y - 1.0

    best = None
    for x0 in _start_points(t, y, experts, top_k, ridge, count=4):
        x0 = np.clip(x0, lo, hi)
        x0[:4] = np.maximum(x0[:4], lo[:4] + 1e-9)  # strictly inside: TRF needs a feasible interior start
        x0[5] = min(max(x0[5], S_BOUNDS[0] + 1e-6), S_BOUNDS[1])
        res = least_squares(residuals, x0, bounds=(lo, hi), method="trf", x_scale="jac",
                            xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=400)
        if best is None or res.cost < best.cost:
            best = res
    x = best.x
    model = SpeedupModel(experts=experts, top_k=top_k, ridge=ridge, bias=x[0], k1=x[1], k2=x[2], k3=x[3],
                         lam=x[4], s=x[5])
    r = best.fun
    return FitResult(model, float(np.sqrt(np.mean(r ** 2))), float(np.max(np.abs(r))))


def fit_linear_times(points: Sequence[tuple[float, float]], basis) -> tuple[float, float]:
    """(intercept, slope) ≥ 0 of ms ≈ intercept + slope·basis(x) for measured (x, ms) pairs, by
    relative least squares (draft time against G(B), reject time against B)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    f = np.asarray(basis(x), dtype=float)
    if len(points) == 1:
        return float(y[0]), 0.0
    from scipy.optimize import least_squares

    res = least_squares(lambda c: (c[0] + c[1] * f) / y - 1.0, x0=[y.min() / 2, 0.0], bounds=([0, 0], [np.inf, np.inf]),
                        method="trf")
    return float(res.x[0]), float(res.x[1])


def fit(target: Sequence[StepTime], draft: Sequence[tuple[int, float]], reject: Sequence[tuple[int, float]],
        experts: int, top_k: int, ridge: float, lower: Mapping[str, float] | None = None) -> FitResult:
    """The whole model from measurements: target steps, (B, ms per draft token) and (B, ms to check)."""
    result = fit_target_times(target, experts, top_k, ridge, lower)
    m = result.model
    db, dk = fit_linear_times(draft, lambda b: roofline(b, m.lam, m.s, m.ridge))
    rb, rk = fit_linear_times(reject, lambda b: b)
    model = SpeedupModel(**{**m.__dict__, "draft_bias": db, "draft_k": dk, "reject_bias": rb, "reject_k": rk})
    return FitResult(model, result.rms_relative_error, result.max_relative_error)


# --- the decision -----------------------------------------------------------------------------

class StepCosts(Protocol):
    """Milliseconds of each part of a step at batch B; verify_ms is None where it is unknown."""

    def ar_ms(self, batch: int) -> float | None: ...

    def verify_ms(self, batch: int, gamma: int) -> float | None: ...

    def draft_ms(self, batch: int) -> float: ...

    def reject_ms(self, batch: int) -> float: ...


@dataclass(frozen=True)
class ModelCosts:
    """Costs from a fitted `SpeedupModel`."""
    model: SpeedupModel

    def ar_ms(self, batch):
        return ar_time(self.model, batch)

    def verify_ms(self, batch, gamma):
        return verify_time(self.model, batch, gamma)

    def draft_ms(self, batch):
        return draft_time(self.model, batch)

    def reject_ms(self, batch):
        return reject_time(self.model, batch)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    # Piecewise linear inside the measured range, None outside it: a table never extrapolates.
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs from measured step times: `target_ms[(B, k)]` is one forward of B sequences × k tokens
    (k = 1 a plain decode step, k = γ+1 a verify step); draft and reject times are per batch or one
    number for every batch."""
    target_ms: Mapping[tuple[int, int], float]
    draft: float | Mapping[int, float] = 0.0
    reject: float | Mapping[int, float] = 0.0
    _by_batch: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        by_batch: dict[int, tuple[list, list]] = {}
        for (b, k), ms in sorted(self.target_ms.items()):
            by_batch.setdefault(b, ([], []))
            by_batch[b][0].append(k)
            by_batch[b][1].append(ms)
        object.__setattr__(self, "_by_batch", by_batch)

    def _target(self, batch: int, k: int) -> float | None:
        batches = sorted(self._by_batch)
        per_batch = [(b, _interpolate(*self._by_batch[b], k)) for b in batches]
        known = [(b, v) for b, v in per_batch if v is not None]
        return _interpolate([b for b, _ in known], [v for _, v in known], batch)

    def ar_ms(self, batch):
        return self._target(batch, 1)

    def verify_ms(self, batch, gamma):
        return self._target(batch, gamma + 1)

    def _per_batch(self, value, batch) -> float:
        if isinstance(value, Mapping):
            keys = sorted(value)
            return float(np.interp(batch, keys, [value[k] for k in keys]))
        return float(value)

    def draft_ms(self, batch):
        return self._per_batch(self.draft, batch)

    def reject_ms(self, batch):
        return self._per_batch(self.reject, batch)


def step_ms(costs: StepCosts, batch: int, gamma: int) -> float | None:
    """One round at batch B with γ drafts per sequence (γ = 0: a plain step); None where a cost is unknown."""
    if gamma == 0:
        return costs.ar_ms(batch)
    verify = costs.verify_ms(batch, gamma)
    if verify is None:
        return None
    return gamma * costs.draft_ms(batch) + verify + costs.reject_ms(batch)


def predicted_speedup(costs: StepCosts, batch: int, gamma: int, alpha: float) -> float | None:
    """Tokens per ms with γ drafts over tokens per ms of plain decoding; None where a cost is unknown."""
    if gamma == 0:
        return 1.0
    ar, step = costs.ar_ms(batch), step_ms(costs, batch, gamma)
    if ar is None or step is None:
        return None
    return tokens_per_step(alpha, gamma) * ar / step


@dataclass(frozen=True)
class Choice:
    gamma: int  # draft tokens per sequence; 0 = decode plainly
    speedup: float  # predicted speedup of that choice (1.0 for plain decoding)
    best_gamma: int  # the best γ ≥ 1 the costs could price, kept for reporting even when not chosen
    best_speedup: float | None


def choose_draft_length(costs: StepCosts, batch: int, alpha: float, max_gamma: int = 8,
                        margin: float = SAFETY_MARGIN) -> Choice:
    """The draft length that maximises predicted throughput at batch B and acceptance α, or 0 unless
    that beats plain decoding by at least `margin` (so `auto` never picks a γ predicted slower)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {alpha}")
    best_gamma, best = 0, None
    for gamma in range(1, max_gamma + 1):
        s = predicted_speedup(costs, batch, gamma, alpha)
        if s is not None and (best is None or s > best):
            best_gamma, best = gamma, s
    if best is not None and best >= 1.0 + margin:
        return Choice(best_gamma, best, best_gamma, best)
    return Choice(0, 1.0, best_gamma, best)
