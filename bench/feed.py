"""What a bench's decode steps feed: random tokens, as llama-bench's generation test does, or the model's own choice.

A random-weight model decoding greedily falls into a trajectory of its own (often one token repeated), and the
experts that trajectory touches, not the shape or the depth, then decide its speed (docs/benchmarks.md, "What
decode feeds"). Random tokens make every run touch experts as a stream of unrelated tokens would, whatever the
model's argmax; the count of experts a run touched says how much of the model it read.
"""
from __future__ import annotations

import random

FEEDS = ("random", "greedy")


def fed_tokens(feed: str, count: int, vocab: int, seed: int) -> tuple[int, ...]:
    """The tokens a decode run feeds in place of the model's choices (engine.requests.Request.fed_tokens):
    "random", `count` drawn uniformly over the whole vocabulary as llama-bench's generation test draws them (its
    `rand() % n_vocab`), from a stream of their own for `seed`, apart from the prompts'; "greedy", none (each step
    feeds the token the model chose)."""
    if feed not in FEEDS:
        raise ValueError(f"feed {feed!r}: one of {', '.join(FEEDS)}")
    if feed == "greedy":
        return ()
    draw = random.Random(f"feed {seed}")
    return tuple(draw.randrange(vocab) for _ in range(count))


def selection_counts(executor) -> dict | None:
    """A copy of the executor's per-layer selection counts (None where it keeps none), to diff with
    `experts_touched`."""
    selections = getattr(executor, "selections", None)
    return None if selections is None else {layer: c.clone() for layer, c in selections.items()}


def experts_touched(executor, before: dict | None) -> int | None:
    """(layer, expert) pairs selected at least once since `before` (selection_counts): how much of the model a run
    read, which decides a decode's speed once experts live in RAM."""
    now = selection_counts(executor)
    if before is None or now is None:
        return None
    return sum(int(((c - before[layer]) if layer in before else c).gt(0).sum()) for layer, c in now.items())
