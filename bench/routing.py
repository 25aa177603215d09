"""What routes a bench's plain decode and prefill runs: the synthetic model's own routers, or a replayed trace.

A random-weight model's routers send most tokens to a few experts a layer, more so in deeper layers, so a GPU that
holds those few serves nearly every pick: a placement of popular experts looks better there than on a trained
model, whose routing spreads over most experts. `--routing no-locality` replays engine.offload.routing_trace's
trace with no skew and no reuse (each pick drawn afresh, every expert alike); `conversation` its preset with the
recent-use locality measured on a real model (docs/expert-cache.md). Popularity is then calibrated from another
trace of the same kind, as the app calibrates on other prompts than the ones it serves. The plain decode and prefill
runs replay it (a prefill round is one trace step of the prompt's tokens, so a spread trace reaches most experts a
layer, as a trained model's prompt does); the depth runs route as the model does.
"""
from __future__ import annotations

from contextlib import contextmanager

from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceRouter, TraceShape,
                                                  calibration_halves, replace_router, synthetic_trace)

ROUTINGS = {"model": None, "no-locality": NO_LOCALITY, "conversation": CONVERSATION}
TRACE_SEED = 5  # the replayed conversation; calibration_halves draws another


def trace_shape(cfg) -> TraceShape:
    """The trace's layers, experts and top-k for a model config (its MoE layers only)."""
    return TraceShape(sum(map(cfg.is_moe_layer, range(cfg.num_layers))), cfg.num_experts, cfg.num_experts_per_tok)


def routing_calibration(cfg, routing: str) -> list | None:
    """Popularity's two halves for prepare_synthetic's `calibration` (None: the model's own calibration decodes)."""
    params = ROUTINGS[routing]
    return None if params is None else calibration_halves(trace_shape(cfg), params)


@contextmanager
def replayed(model, cfg, moe_layers: list[int], routing: str, tokens: int, steps: int):
    """The model's routers replaced by `steps` positions of `routing`'s trace, each of `tokens` tokens (a decode
    run's batch; the trace repeats when a run takes more), for the time of the block; nothing where routing is the
    model's own."""
    params = ROUTINGS[routing]
    if params is None:
        yield
        return
    trace = list(synthetic_trace(trace_shape(cfg), steps, params, tokens=tokens, seed=TRACE_SEED))
    replace_router(model, TraceRouter(trace, moe_layers, cfg.num_experts_per_tok))
    try:
        yield
    finally:
        replace_router(model, None)
