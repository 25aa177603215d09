"""Routing traces: which experts each layer chose at each step, to replay and to generate.

A trace is JSON Lines: a header, then one line per step.

    {"format": "moedesk-routing-trace", "version": 1, "layers": L, "experts": E, "top_k": K}
    {"experts": [[ids of layer 0, K per token, tokens in order], [ids of layer 1], ...]}

Plain text, so a trace recorded from a real conversation can be read, cut and shared; a step may hold
several tokens (prefill, batches), each contributing K ids per layer.

`synthetic_trace` makes traces with the two properties measured on real MoE models that decide how well a
GPU expert cache does (docs/expert-cache.md has the sources): a static skew (some experts are popular
everywhere) and recent-use locality (an expert a layer just used is likely to be used again soon).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from moedesk.engine.errors import MoedeskError

if TYPE_CHECKING:
    import torch

FORMAT = "moedesk-routing-trace"


@dataclass(frozen=True)
class TraceShape:
    layers: int
    experts: int
    top_k: int

    def header(self) -> dict:
        return {"format": FORMAT, "version": 1, "layers": self.layers, "experts": self.experts, "top_k": self.top_k}


def write_trace(path, shape: TraceShape, steps) -> None:
    """Write `steps` (each a sequence of per-layer id arrays) as a trace file."""
    with open(path, "w") as f:
        f.write(json.dumps(shape.header()) + "\n")
        for step in steps:
            f.write(json.dumps({"experts": [np.asarray(ids).astype(int).tolist() for ids in step]}) + "\n")


def read_trace(path) -> tuple[TraceShape, list[list[np.ndarray]]]:
    """(shape, steps); each step a list of one int array per layer. Bad files raise MoedeskError, one line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MoedeskError(f"{path}: cannot read routing trace ({e})") from None
    if not lines:
        raise MoedeskError(f"{path}: empty routing trace")
    try:
        header = json.loads(lines[0])
        shape = TraceShape(int(header["layers"]), int(header["experts"]), int(header["top_k"]))
        ok = header.get("format") == FORMAT and header.get("version") == 1
    except (ValueError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok or min(shape.layers, shape.experts, shape.top_k) < 1:
        raise MoedeskError(f"{path}: line 1 is not a {FORMAT} version 1 header")
    steps = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            layers = [np.asarray(ids, dtype=np.int64) for ids in json.loads(line)["experts"]]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise MoedeskError(f"{path}: line {number} is not a step of expert ids") from None
        bad = len(layers) != shape.layers or any(
            ids.ndim != 1 or len(ids) % shape.top_k or (len(ids) and (ids.min() < 0 or ids.max() >= shape.experts))
            for ids in layers)
        if bad:
            raise MoedeskError(f"{path}: line {number} does not hold {shape.layers} layers of ids in "
                               f"[0, {shape.experts}), {shape.top_k} per token")
        steps.append(layers)
    return shape, steps


def step_counts(step: list[np.ndarray], experts: int) -> np.ndarray:
    """Selections per [layer, expert] in one step."""
    return np.stack([np.bincount(ids, minlength=experts) for ids in step])


@dataclass(frozen=True)
class TraceParams:
    """What a synthetic trace is made of (docs/expert-cache.md: what each is and which measurements set it).

    skew: Zipf exponent of each layer's static popularity over its experts (0: every expert equally popular).
    reuse: probability that a choice is an expert this layer used within the last `window` steps.
    window: the reuse distance, in steps.
    """

    skew: float = 0.0
    reuse: float = 0.0
    window: int = 16


# No locality: each step drawn afresh from a static distribution, which a fixed placement already serves.
NO_LOCALITY = TraceParams(skew=0.0, reuse=0.0)
# Little static skew, strong recent-use locality: the routing reported for a recent 512-expert model.
CONVERSATION = TraceParams(skew=0.35, reuse=0.8, window=16)


def synthetic_trace(shape: TraceShape, steps: int, params: TraceParams, tokens: int = 1, seed: int = 0,
                    model_seed: int = 0) -> Iterator[list[np.ndarray]]:
    """`steps` steps of `tokens` tokens each, every token choosing top_k distinct experts per layer.
    model_seed fixes which experts are popular (the model's property), seed the conversation."""
    e, k = shape.experts, shape.top_k
    ranks = np.arange(1, e + 1, dtype=float)
    weights = ranks ** -params.skew
    model = np.random.default_rng(model_seed)
    static = [model.permutation(weights / weights.sum()) for _ in range(shape.layers)]  # Zipf, a random order
    rng = np.random.default_rng(seed)
    recent = [np.full(e, -np.inf) for _ in range(shape.layers)]  # the last step each expert was used
    for step in range(steps):
        chosen = []
        for layer in range(shape.layers):
            warm = np.flatnonzero(recent[layer] >= step - params.window)
            ids = np.empty(tokens * k, dtype=np.int64)
            for t in range(tokens):
                picked: list[int] = []
                while len(picked) < k:
                    pool = np.setdiff1d(warm, picked, assume_unique=True)
                    if len(pool) and rng.random() < params.reuse:
                        picked.append(int(rng.choice(pool)))
                        continue
                    p = static[layer].copy()
                    p[picked] = 0.0
                    picked.append(int(rng.choice(e, p=p / p.sum())))
                ids[t * k:(t + 1) * k] = picked
            recent[layer][ids] = step
            chosen.append(ids)
        yield chosen


def calibration_halves(shape: TraceShape, params: TraceParams, steps: int = 300,
                       seed: int = 99) -> list[list[list[int]]]:
    """Selections per [layer, expert] of another conversation of the same model (`steps` positions of a trace of
    `params`, seed apart from the replayed one's), in two halves: what the engine's calibration gives
    ExpertOrchestra.calibrate, for a bench that replays traces in place of the model's routing."""
    counts = [step_counts(s, shape.experts) for s in synthetic_trace(shape, steps, params, seed=seed)]
    half = len(counts) // 2
    return [sum(counts[:half]).tolist(), sum(counts[half:]).tolist()]


class TraceRouter:
    """Replays a trace in place of the model's router (`replace_router`): each step's ids per layer,
    the trace's tokens repeated or cut to the step's, the trace itself repeated when it runs out. Expert
    outputs are then wrong, so only for measuring speed on routing of a known shape.

    The trace and the step counter live on the device, and a step's ids are computed there: the first MoE layer
    advances the counter and gathers every layer's ids into one fixed buffer per token count, of which each layer
    gets its row. So a CUDA graph captured over the router replays the trace as it would read the router, with
    nothing run on the host; the host sees the ids where it sees the router's (the graph's copy, or the eager
    forward's read)."""

    def __init__(self, steps: list[list[np.ndarray]], layers: list[int], top_k: int):
        if not steps:
            raise MoedeskError("the routing trace has no steps")
        if len(steps[0]) < len(layers):
            raise MoedeskError(f"the routing trace has {len(steps[0])} layers; the model has {len(layers)} MoE layers")
        self.top_k = top_k
        self.row = {layer: i for i, layer in enumerate(sorted(layers))}
        self.first = min(layers)
        self.flat, self.offsets, self.lengths = packed_trace(steps, len(layers))
        self._device: dict | None = None  # the tensors above on the routing's device, made at the first step
        self._current: dict[int, torch.Tensor] = {}  # tokens n -> this step's ids of every layer [L, n, K]
        self._pairs: dict[int, torch.Tensor] = {}  # tokens n -> 0 .. n * K - 1, the step's pair positions [1, n * K]

    @property
    def step(self) -> int:
        """Trace positions taken so far, less one (-1 before the first): read from the device, a wait."""
        return -1 if self._device is None else int(self._device["taken"].item()) - 1

    def ids(self, layer: int, like):
        """The ids for `layer` this step, shaped and placed like the router's `like` [N, K]: a view of a buffer
        that the next step overwrites in place (CUDA graphs read it there)."""
        n, k = like.shape
        if k != self.top_k:
            raise MoedeskError(f"the routing trace has top-{self.top_k}; the model routes to {k}")
        if layer == self.first:
            self._advance(n, like)
        current = self._current.get(n)
        if current is None:
            raise MoedeskError(f"MoE layer {layer} routed {n} tokens before the first MoE layer did")
        return current[self.row[layer]].to(like.device, like.dtype)

    def _advance(self, n: int, like) -> None:
        """The next trace position's ids of every layer into `_current[n]`: device work alone (captured in a graph,
        it replays the trace)."""
        import torch

        if self._device is None:
            with torch.inference_mode(False):  # updated in place inside and outside inference mode alike
                self._device = {"flat": torch.from_numpy(self.flat).to(like.device, like.dtype),
                                "offsets": torch.from_numpy(self.offsets).to(like.device),
                                "lengths": torch.from_numpy(self.lengths).to(like.device),
                                "taken": torch.zeros(1, dtype=torch.int64, device=like.device)}
        d = self._device
        if n not in self._current:
            with torch.inference_mode(False):
                self._current[n] = torch.empty((len(self.row), n, self.top_k), dtype=d["flat"].dtype,
                                               device=d["flat"].device)
                self._pairs[n] = torch.arange(n * self.top_k, device=d["flat"].device)[None]
        at = torch.remainder(d["taken"], len(self.offsets))
        d["taken"].add_(1)
        start, length = d["offsets"].index_select(0, at).T, d["lengths"].index_select(0, at).T  # [L, 1]
        index = start + torch.remainder(self._pairs[n], length)  # np.resize: a layer's ids repeated, or cut, to n * K
        torch.index_select(d["flat"], 0, index.view(-1), out=self._current[n].view(-1))


def packed_trace(steps: list[list[np.ndarray]], layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, offsets [S, layers], lengths [S, layers]): the first `layers` layers' ids of every step one after
    another, and where each step's layer starts and how many it has. Each must have one at least."""
    lengths = np.array([[len(step[r]) for r in range(layers)] for step in steps], dtype=np.int64)
    if not lengths.all():
        s, r = np.argwhere(lengths == 0)[0]
        raise MoedeskError(f"the routing trace's step {s + 1} has no ids for MoE layer {r + 1}")
    flat = np.concatenate([np.asarray(step[r], dtype=np.int64) for step in steps for r in range(layers)])
    offsets = (np.cumsum(lengths.reshape(-1)) - lengths.reshape(-1)).reshape(lengths.shape)
    return flat, offsets, lengths


class TraceRecorder:
    """Writes the routing a model runs as a trace (`record_routing`): a step begins each time the first MoE layer
    routes, and holds every layer's ids for that step's tokens, in token order (a prefill's many, a decode's one).
    Each step is written when the next begins, the last by `close`: a run cut short keeps its finished steps."""

    def __init__(self, path, layers: list[int], experts: int, top_k: int):
        self.row = {layer: i for i, layer in enumerate(sorted(layers))}
        self.first, self.top_k = min(layers), top_k
        self.shape = TraceShape(len(layers), experts, top_k)
        self._file = open(path, "w")
        self._file.write(json.dumps(self.shape.header()) + "\n")
        self._step: list[list[int]] | None = None
        self.steps = 0

    def ids(self, layer: int, ids) -> None:
        """Layer `layer` routed its tokens to `ids` [N, K] (a tensor or array)."""
        if layer == self.first:
            self._flush()
            self._step = [[] for _ in self.row]
        if self._step is not None:
            self._step[self.row[layer]] += np.asarray(ids.tolist(), dtype=np.int64).reshape(-1).tolist()

    def _flush(self) -> None:
        if self._step is not None:
            self._file.write(json.dumps({"experts": self._step}) + "\n")
            self._file.flush()
            self.steps += 1
            self._step = None

    def close(self) -> None:
        self._flush()
        self._file.close()


def record_routing(model, recorder: TraceRecorder | None) -> None:
    """Record `model`'s routing into `recorder` (None: stop): its MoE layers route as before, and each layer's ids
    go to the recorder. Reads the ids on the host every layer, so only eagerly (no CUDA graphs)."""
    for moe in model.moe_blocks():
        moe.__dict__.pop("route", None)
        if recorder is not None:
            own = moe.route

            def route(x, own=own, layer=moe.layer):
                weights, ids = own(x)
                recorder.ids(layer, ids)
                return weights, ids

            moe.route = route


def replace_router(model, router: "TraceRouter | None") -> None:
    """Route `model`'s MoE layers by `router` (None: by their own routers again), weights as the router gives."""
    for moe in model.moe_blocks():
        moe.__dict__.pop("route", None)  # back to the class's method
        if router is not None:
            own = moe.route
            moe.route = lambda x, own=own, layer=moe.layer: (lambda w, ids: (w, router.ids(layer, ids)))(*own(x))
