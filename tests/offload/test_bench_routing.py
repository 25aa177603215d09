"""`moedesk bench --routing`: the plain decode and prefill runs routed by a replayed trace (bench/routing.py) in place
of the random-weight model's routers, which favour a few experts; popularity calibrated from another trace of the
same kind.
"""
import numpy as np
import pytest

from moedesk.app.cli import main
from moedesk.bench import routing
from moedesk.bench.budget import budget_for_experts
from moedesk.bench.synthetic import bench_context, format_results, run_bench
from moedesk.engine.errors import MoedeskError
from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.offload.routing_trace import NO_LOCALITY, calibration_halves, step_counts, synthetic_trace

LAYERS = 2  # tiny-moe's first two: MoE layers of 8 experts, top 2


def test_decode_and_prefill_runs_touch_only_the_experts_their_trace_picks(monkeypatch):
    """A trace that sends every token to experts 6 and 7: the plain decode runs (one sequence and a batch) and the
    prefill between them (a trace step of the prompt's tokens a round) touch those two a layer and no other."""
    picked = []

    def two_experts(shape, steps, params, tokens=1, seed=0):
        picked.append((params, tokens, seed))
        for _ in range(steps):
            yield [np.array([6, 7] * tokens) for _ in range(shape.layers)]

    monkeypatch.setattr(routing, "synthetic_trace", two_experts)
    budget = budget_for_experts(shape_config("tiny-moe", LAYERS), 2, bench_context((16,), 6), "dense", "cpu")
    report = run_bench("tiny-moe", LAYERS, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=2,
                       log=lambda *a: None, routing="no-locality")
    decode, prefill, batched = report["results"]
    assert (decode["mode"], batched["mode"]) == ("decode", "batched_decode")
    assert decode["experts_touched"] == batched["experts_touched"] == 2 * LAYERS
    assert prefill["experts"]["active_experts"] == 2 * LAYERS * prefill["rounds"]  # experts 6 and 7, each round
    assert picked == [(NO_LOCALITY, 1, routing.TRACE_SEED), (NO_LOCALITY, 16, routing.TRACE_SEED),
                      (NO_LOCALITY, 2, routing.TRACE_SEED)]
    assert report["routing"] == "no-locality"
    assert "routed by a replayed no-locality trace" in format_results(report)


def test_the_model_routes_unless_asked_and_calibration_comes_from_another_trace():
    cfg = shape_config("tiny-moe", LAYERS)
    assert routing.routing_calibration(cfg, "model") is None
    shape = routing.trace_shape(cfg)
    assert (shape.layers, shape.experts, shape.top_k) == (LAYERS, 8, 2)
    halves = routing.routing_calibration(cfg, "no-locality")
    assert halves == calibration_halves(shape, NO_LOCALITY)
    assert len(halves) == 2 and np.array(halves).shape == (2, LAYERS, 8)
    assert np.array(halves).sum() == 300 * LAYERS * 2  # 300 one-token positions, two picks a layer
    # another conversation than the one replayed
    replayed = sum(step_counts(s, 8) for s in synthetic_trace(shape, 300, NO_LOCALITY, seed=routing.TRACE_SEED))
    assert replayed.tolist() != (np.array(halves[0]) + np.array(halves[1])).tolist()


def test_routing_is_refused_where_runs_route_as_the_model_does(capsys, monkeypatch):
    from moedesk.bench import synthetic

    asked = []

    def stop(*a, routing=None, **k):
        asked.append(routing)
        raise MoedeskError("stopped before building")

    monkeypatch.setattr(synthetic, "run_bench", stop)
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--routing", "conversation"]) == 2
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu"]) == 2
    assert asked == ["conversation", "model"]
    capsys.readouterr()
    for other in (["--engine", "llama.cpp"], ["--beams", "4"]):
        assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--routing", "no-locality", *other]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "--routing" in line and len(asked) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--routing", "skewed"])
