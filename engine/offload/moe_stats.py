"""How many experts a group of tokens touches, and how many tokens each touched expert gets.

These two numbers decide what an MoE step costs once experts live in RAM: every distinct
expert touched is one weight read (CPU) or one copy (PCIe), whatever its token count, while
the tokens per touched expert decide whether that read is amortised. They are the N(t) and
T_exp(t) of MoESD (Huang et al.), used by the performance model and the benchmark bounds.

Model: each token picks `top_k` distinct experts out of `num_experts` uniformly at random,
independently of the other tokens. One expert is missed by one token with probability
1 - K/E, so by all t tokens with probability (1 - K/E)^t. Real routers are skewed and
neighbouring tokens overlap, which touches fewer experts; `expected_active_experts_from_shares`
takes measured per-expert selection shares for that case.
"""
from __future__ import annotations

import numpy as np


def _check(num_experts: int, top_k: int) -> None:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")


def _as_result(values: np.ndarray, like):
    return float(values) if np.ndim(like) == 0 else values


def expected_active_experts(tokens, num_experts: int, top_k: int):
    """N(t) = E·(1 - (1 - K/E)^t): expected number of distinct experts that t tokens select.

    `tokens` may be a number or an array (the perf model fits over arrays); t = 0 gives 0.
    """
    _check(num_experts, top_k)
    t = np.asarray(tokens, dtype=float)
    if np.any(t < 0):
        raise ValueError("tokens must be >= 0")
    miss = 1.0 - top_k / num_experts
    return _as_result(num_experts * (1.0 - miss ** t), tokens)


def tokens_per_active_expert(tokens, num_experts: int, top_k: int):
    """T_exp(t) = K·t / N(t) = ρt / (1 - (1-ρ)^t): the average load of an expert that is touched.

    It is a ratio of expectations (all selections over all touched experts), which is what a
    bandwidth bound needs: bytes scale with N(t), arithmetic with K·t. It is 1 for one token
    and approaches K·t/E once every expert is active. t = 0 gives 0.
    """
    _check(num_experts, top_k)
    t = np.asarray(tokens, dtype=float)
    active = np.asarray(expected_active_experts(t, num_experts, top_k), dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(t > 0, top_k * t / np.where(active > 0, active, 1.0), 0.0)
    return _as_result(per, tokens)


def expected_active_experts_from_shares(shares, tokens) -> float:
    """Expected distinct experts touched by t tokens when expert e is picked by one token with probability shares[e].

    Σ_e 1 - (1 - p_e)^t, the same independence assumption with measured popularity instead of
    uniform routing (shares sum to top_k; uniform shares K/E give back N(t)). Restricting
    `shares` to the CPU-resident experts gives the expected number of offloaded experts a step
    must read.
    """
    p = np.clip(np.asarray(shares, dtype=float), 0.0, 1.0)
    if tokens < 0:
        raise ValueError("tokens must be >= 0")
    return float(np.sum(1.0 - (1.0 - p) ** tokens))
