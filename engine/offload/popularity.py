"""How far calibration counts can be trusted to predict the routing to come.

Counts from a few prompts are a sample. They can look skewed (a few experts taking most
selections) while other prompts route elsewhere: the random-weight benchmark models do exactly
that, each sequence settling on its own experts. Placement trusting such counts fills the GPU
with experts the next prompt does not use, where whole layers would have paid.

So the calibration prompts are counted in two halves, and each half is asked to predict the
other. The estimate placement uses is the counts of both halves, shrunk toward even routing by
the weight that predicts the held-out half best (a mixture of the measured shares and uniform,
its weight fitted by maximum likelihood, as in additive smoothing or Jelinek–Mercer
interpolation). Routing that repeats keeps its shape; routing that does not is treated as even.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def shares(counts: np.ndarray) -> np.ndarray:
    """Per layer (row), each expert's share of the selections; a layer without counts is spread evenly."""
    counts = np.asarray(counts, dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    even = np.full_like(counts, 1.0 / counts.shape[1])
    return np.divide(counts, totals, out=even, where=totals > 0)


def held_out_log_likelihood(evenness: float, halves: Sequence[np.ndarray]) -> float:
    """Log-likelihood of each half's selections under the other half's shares mixed with even routing."""
    total = 0.0
    for fit, held_out in ((halves[0], halves[1]), (halves[1], halves[0])):
        p = (1.0 - evenness) * shares(fit) + evenness / fit.shape[1]
        picked = held_out > 0
        with np.errstate(divide="ignore"):  # an expert one half never picked, at weight 0: -inf, as it should
            total += float(np.sum(held_out[picked] * np.log(p[picked])))
    return total


def fitted_evenness(halves: Sequence[np.ndarray]) -> float:
    """The weight of even routing, in [0, 1], under which each half best predicts the other.

    The log-likelihood is concave in the weight (a sum of logs of affine functions), so a bounded
    scalar search finds its maximum. 0: the halves agree so well that the counts stand as measured;
    1: one half says nothing about the other. Halves without counts give no evidence either way: 0.
    """
    halves = [np.asarray(h, dtype=float) for h in halves]
    if len(halves) != 2 or halves[0].shape != halves[1].shape:
        raise ValueError("need two halves of counts of the same shape")
    if not (halves[0].sum() > 0 and halves[1].sum() > 0):
        return 0.0
    from scipy.optimize import minimize_scalar  # here, not at the top: a start that fits nothing skips its import

    result = minimize_scalar(lambda w: -held_out_log_likelihood(w, halves), bounds=(0.0, 1.0), method="bounded",
                             options={"xatol": 1e-4})
    return float(result.x)


def estimated_popularity(halves: Sequence[np.ndarray]) -> tuple[np.ndarray, float]:
    """(counts for placement, fitted evenness): both halves' counts per layer, shrunk toward even routing.

    Each layer keeps its number of selections; only their spread over experts changes, so layers
    still compare by traffic and a layer's experts keep their order.
    """
    evenness = fitted_evenness(halves)
    counts = np.asarray(halves[0], dtype=float) + np.asarray(halves[1], dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    return totals * ((1.0 - evenness) * shares(counts) + evenness / counts.shape[1]), evenness
