"""Expected experts touched and tokens per touched expert, against simulated top-K routing."""
import numpy as np
import pytest

from moedesk.engine.offload.moe_stats import expected_active_experts, expected_active_experts_from_shares, tokens_per_active_expert


def simulate_distinct(num_experts: int, top_k: int, tokens: int, trials: int, rng, weights=None) -> np.ndarray:
    """Distinct experts per trial when each token picks top_k distinct experts.

    Uniform: the top_k smallest of uniform keys. Skewed: Gumbel top-k on log-weights, i.e.
    sampling without replacement proportionally to weights.
    """
    keys = rng.random((trials, tokens, num_experts))
    if weights is not None:
        keys = -(np.log(weights) - np.log(-np.log(keys)))
    picked = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k]
    hit = np.zeros((trials, num_experts), dtype=bool)
    np.put_along_axis(hit, picked.reshape(trials, -1), True, axis=1)
    return hit.sum(axis=1), picked


def test_design_example():
    # docs/measurements.md, "Facts measured on the GPU box": five tokens of one sequence route to about
    # 6.1 of Mixtral's 8 experts.
    assert expected_active_experts(5, 8, 2) == pytest.approx(8 * (1 - 0.75**5))
    assert expected_active_experts(5, 8, 2) == pytest.approx(6.10, abs=0.01)


def test_limits():
    assert expected_active_experts(0, 8, 2) == 0.0
    assert expected_active_experts(1, 128, 8) == pytest.approx(8)
    assert expected_active_experts(10_000, 128, 8) == pytest.approx(128)
    assert tokens_per_active_expert(0, 8, 2) == 0.0
    assert tokens_per_active_expert(1, 128, 8) == pytest.approx(1.0)
    assert tokens_per_active_expert(4096, 8, 2) == pytest.approx(4096 * 2 / 8)
    assert expected_active_experts(7, 8, 8) == 8.0  # every expert picked by every token


def test_arrays_in_arrays_out():
    t = np.array([0, 1, 5, 16])
    n = expected_active_experts(t, 8, 2)
    assert isinstance(n, np.ndarray) and n.shape == (4,)
    assert np.all(np.diff(n) > 0)
    assert tokens_per_active_expert(t, 8, 2) == pytest.approx([tokens_per_active_expert(int(x), 8, 2) for x in t])
    assert isinstance(tokens_per_active_expert(3, 8, 2), float)


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (64, 6), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 48])
def test_matches_monte_carlo_uniform_routing(num_experts, top_k, tokens):
    rng = np.random.default_rng(num_experts * 1000 + tokens)
    trials = 1500
    distinct, _ = simulate_distinct(num_experts, top_k, tokens, trials, rng)
    stderr = distinct.std() / np.sqrt(trials)
    assert expected_active_experts(tokens, num_experts, top_k) == pytest.approx(distinct.mean(),
                                                                                  abs=4 * stderr + 0.01)
    # Tokens per touched expert: all selections over all touched experts.
    measured = top_k * tokens * trials / distinct.sum()
    assert tokens_per_active_expert(tokens, num_experts, top_k) == pytest.approx(measured, rel=0.01)


def test_more_tokens_per_expert_once_all_are_touched():
    # MoESD's point: past saturation extra tokens add arithmetic, not bytes.
    t = np.arange(1, 200)
    per = tokens_per_active_expert(t, 8, 2)
    assert np.all(np.diff(per) > 0)
    assert per[4] < 2 and per[-1] == pytest.approx(199 * 2 / 8, rel=1e-6)


def test_measured_shares_match_monte_carlo_skewed_routing():
    rng = np.random.default_rng(7)
    num_experts, top_k, tokens, trials = 16, 2, 6, 4000
    weights = rng.zipf(1.8, num_experts).astype(float)
    distinct, picked = simulate_distinct(num_experts, top_k, tokens, trials, rng, weights)
    # Per-token selection shares, as the executor's counters would measure them.
    shares = np.bincount(picked.ravel(), minlength=num_experts) / (trials * tokens)
    assert shares.sum() == pytest.approx(top_k)
    stderr = distinct.std() / np.sqrt(trials)
    assert expected_active_experts_from_shares(shares, tokens) == pytest.approx(distinct.mean(), abs=4 * stderr + 0.01)
    # Skew touches fewer experts than uniform routing would.
    assert expected_active_experts_from_shares(shares, tokens) < expected_active_experts(tokens, num_experts, top_k)


def test_uniform_shares_give_back_the_closed_form():
    assert expected_active_experts_from_shares(np.full(128, 8 / 128), 16) == pytest.approx(
        expected_active_experts(16, 128, 8))


def test_bad_arguments():
    with pytest.raises(ValueError):
        expected_active_experts(4, 8, 9)
    with pytest.raises(ValueError):
        expected_active_experts(-1, 8, 2)
    with pytest.raises(ValueError):
        expected_active_experts_from_shares([0.5, 0.5], -1)
