"""How far calibration counts are trusted: each half of the calibration predicts the other."""
import numpy as np
import pytest

from moedesk.engine.offload.placement import LayerCosts, plan_placement
from moedesk.engine.offload.popularity import estimated_popularity, fitted_evenness, held_out_log_likelihood, shares


def _halves(rng, shares_a, shares_b, selections=2400):
    return [np.array([rng.multinomial(selections, p) for p in s]) for s in (shares_a, shares_b)]


def test_shares_spread_a_layer_without_counts_evenly():
    assert np.allclose(shares(np.array([[3, 1], [0, 0]])), [[0.75, 0.25], [0.5, 0.5]])


def test_routing_that_repeats_keeps_its_shape():
    rng = np.random.default_rng(0)
    skew = rng.dirichlet(np.full(64, 0.3), size=4)
    assert fitted_evenness(_halves(rng, skew, skew)) < 0.1


def test_halves_that_route_to_different_experts_count_as_even_routing():
    # Each half skewed, but toward its own experts (the random-weight benchmark models): no evidence.
    rng = np.random.default_rng(1)
    a, b = rng.dirichlet(np.full(64, 0.3), size=4), rng.dirichlet(np.full(64, 0.3), size=4)
    assert fitted_evenness(_halves(rng, a, b)) > 0.8


def test_the_fitted_weight_is_the_held_out_maximum():
    rng = np.random.default_rng(2)
    skew = rng.dirichlet(np.full(32, 0.5), size=3)
    halves = _halves(rng, skew, 0.5 * skew + 0.5 / 32, selections=300)  # half agree, half even
    w = fitted_evenness(halves)
    assert 0.05 < w < 0.95
    best = held_out_log_likelihood(w, halves)
    for other in (0.0, w - 0.05, w + 0.05, 1.0):
        assert held_out_log_likelihood(other, halves) <= best + 1e-9


def test_estimate_keeps_each_layers_traffic_and_expert_order():
    halves = [np.array([[6, 2, 0, 0], [1, 1, 1, 1]]), np.array([[5, 3, 0, 0], [1, 1, 1, 1]])]
    counts, w = estimated_popularity(halves)
    assert counts.sum(axis=1) == pytest.approx([16, 8])
    assert list(np.argsort(-counts[0], kind="stable")) == [0, 1, 2, 3]
    assert 0 < w < 1 and counts[0, 2] > 0  # unseen experts get some of the mass


def test_no_counts_give_no_evidence():
    zero = np.zeros((2, 4))
    assert fitted_evenness([zero, zero]) == 0.0
    with pytest.raises(ValueError):
        fitted_evenness([zero, np.zeros((2, 5))])


def test_unrepeatable_skew_lets_the_placement_take_whole_layers():
    # Raw counts look skewed enough that popularity order wins; shrunk, the same halves say even routing,
    # and whole layers (which skip the host) win: the benchmark's quarter case.
    rng = np.random.default_rng(3)
    layers, experts, fits = 12, 32, 96
    a, b = rng.dirichlet(np.full(experts, 0.2), size=layers), rng.dirichlet(np.full(experts, 0.2), size=layers)
    halves = _halves(rng, a, b, selections=400)
    costs = LayerCosts(roundtrip_ms=0.1, resident_launch_ms=0.05, cpu_expert_ms=0.07)
    raw = plan_placement(1, layers, experts, halves[0] + halves[1], fits, 0, layer_costs=costs, top_k=8)
    shrunk = plan_placement(1, layers, experts, estimated_popularity(halves)[0], fits, 0, layer_costs=costs, top_k=8)
    assert raw.on_gpu.all(axis=1).sum() == 0
    assert shrunk.on_gpu.all(axis=1).sum() == 3
