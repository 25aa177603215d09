"""Decode and prefill at a depth: `depth` tokens of context prefilled first, then the runs measured over them,
as llama-bench's -d measures (tests/perf/compare_llamacpp.sh runs both on one machine).

The context is prefilled in the engine's prefill pieces through the same Decoder the engine runs, so attention
reads a cache as deep as a long conversation's; decode is timed from its second step (the first captures the
CUDA graphs), and the prefill piece is the best of `repeat` forwards of `chunk` tokens at positions depth onward.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moedesk.bench.feed import experts_touched, fed_tokens, selection_counts
from moedesk.engine.generation.decoder import Decoder, synchronize
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.generation.scheduler import default_prefill_chunk
from moedesk.engine.requests import Request, SamplingParams


def depth_context(depth: int, decode_tokens: int, chunk: int) -> int:
    """Positions a run at `depth` needs: the context, then the longer of the decode run and the prefill piece."""
    return depth + max(chunk, decode_tokens + 2) + 1


@dataclass(frozen=True)
class DepthTimes:
    depth: int
    decode_steps: int  # the decode steps timed (the first, which captures graphs, is not)
    decode_s: float
    chunk: int
    prefill_s: float  # the best forward of `chunk` tokens at positions depth onward
    feed: str = "random"  # what each decode step fed (bench.feed.fed_tokens)
    experts_touched: int | None = None  # (layer, expert) pairs the timed decode steps selected at least once


def measure_at_depth(model, executor, device, dtype, prompt: list[int], depth: int, decode_tokens: int = 64,
                     chunk: int = 512, repeat: int = 2, graphs: bool | None = None,
                     piece: int | None = None, around_decode=None, feed: str = "random", seed: int = 0) -> DepthTimes:
    """Decode and a prefill piece of one sequence after `depth` tokens of context, the first depth + chunk tokens
    of `prompt` (the context, then the piece). piece: prompt tokens per prefill forward while filling the context
    (default: the engine's for the device). around_decode: a context manager entered around the timed decode steps
    alone (a profiler, which should see neither the context's prefill nor the step that captures graphs).
    feed, seed: what each decode step feeds (bench.feed.fed_tokens: random tokens of `seed`'s stream, or the
    model's own choice), through the decoder's own step."""
    from moedesk.engine.generation.cuda_graphs import graphs_wanted

    device = torch.device(device)
    use_graphs = graphs_wanted(device) if graphs is None else graphs
    length = depth_context(depth, decode_tokens, chunk)
    runner = ModelRunner(model, device, dtype, length, graphs=use_graphs)
    runner.reserve(1, length)
    decoder = Decoder(runner, executor, None)
    params = SamplingParams(max_new_tokens=decode_tokens + 2, temperature=0, ignore_eos=True)
    if depth < 1 or len(prompt) < depth + chunk:
        raise ValueError(f"need depth >= 1 and {depth + chunk} prompt tokens, got {depth} and {len(prompt)}")
    fed = fed_tokens(feed, params.max_new_tokens, model.cfg.vocab_size, seed)
    seq = decoder.start(Request(prompt[:depth], params, fed_tokens=fed), 0)
    piece = piece or default_prefill_chunk(device)
    while seq.prefilled < len(seq.request.prompt_ids):
        list(decoder.prefill([seq], budget=piece))

    tokens = torch.tensor([prompt[depth:depth + chunk]], device=device)
    positions = torch.arange(depth, depth + chunk, device=device)[None]
    last = torch.tensor([chunk - 1], device=device)
    best = float("inf")
    for _ in range(repeat):  # the piece rewrites the same positions each time: the decode below overwrites them
        synchronize(device)
        t0 = time.perf_counter()
        runner.prefill(tokens, positions, executor, logits_at=last)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)

    list(decoder.decode([seq]))  # captures the graphs: not what a step costs
    synchronize(device)
    if hasattr(executor, "stats"):
        executor.stats = type(executor.stats)()
    before = selection_counts(executor)
    with around_decode or nullcontext():
        t0 = time.perf_counter()
        for _ in range(decode_tokens - 2):
            list(decoder.decode([seq]))
        synchronize(device)
        elapsed = time.perf_counter() - t0
    return DepthTimes(depth, decode_tokens - 2, elapsed, chunk, best, feed, experts_touched(executor, before))
