"""The target's step times T(B, k) that auto mode prices rounds at: measured through the forwards speculation
runs (CUDA graphs where the engine replays them), once per machine, model and placement, and cached.
"""
from __future__ import annotations

import time

import torch

from moedesk.engine.generation.decoder import synchronize


def graphs_like(graphs):
    """The speculator's graphs as the engine's plain decode has them: none, or GraphedDecode over its own cache
    that captures (or runs the segments eagerly) as the engine's does."""
    if graphs is None:
        return False
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    return lambda model, cache: GraphedDecode(model, cache, capture=graphs.capture)


STEP_TIMES_FORMAT = 2  # 2: timed through CUDA graphs where the engine's forwards replay them


MEASURED_BATCHES = (1, 2, 4, 8, 16, 32)


def measure_step_times(model, executor, cfg, device, dtype, batches, max_k: int, prompt: int = 32,
                       repeat: int = 3, graphs=None, progress=None) -> dict[str, float]:
    """T(B, k) in ms: one forward of B sequences with k new tokens each after a `prompt`-token prefix (the
    best of `repeat`), as "B,k" keys. Random tokens: what is timed is where the experts are and how many
    distinct ones the tokens reach, which random routing over-estimates only slightly.

    graphs: as Speculator takes it (None: where the device wants CUDA graphs). The forwards are then replayed
    from graphs captured for each shape, as plain decode steps and speculative verify forwards run, so auto
    prices what runs: eager forwards pay kernel launches every step that the graphed plain step does not
    (docs/measurements.md, "Speculation and the benches")."""
    if graphs is None:
        from moedesk.engine.generation.cuda_graphs import graphs_wanted

        graphs = graphs_wanted(torch.device(device))
    if not getattr(model, "supports_graphs", True):  # a model graphs cannot replay: the runner decodes it eagerly, so timed so
        graphs = None
    if graphs and not callable(graphs):
        from moedesk.engine.generation.cuda_graphs import GraphedDecode

        graphs = GraphedDecode
    out = {}
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        cache = model.new_cache(b, prompt + max_k, dtype, device)
        tokens = torch.randint(3, cfg.vocab_size, (b, prompt + max_k), generator=gen).to(device)
        positions = torch.arange(prompt + max_k, device=device).expand(b, -1)
        model(tokens[:, :prompt], positions[:, :prompt], cache, executor)
        graphed = graphs(model, cache) if graphs else None
        if graphed is not None:
            graphed.capture_after = 1  # every shape here is timed again at once

        def forward(k):
            args = tokens[:, prompt:prompt + k], positions[:, prompt:prompt + k]
            if graphed is None or graphed.forward(*args, executor) is None:
                model(*args, cache, executor, drafts=True)  # as a verify forward runs (recurrent layers keep states)

        for k in range(1, max_k + 1):
            if graphed is not None:
                forward(k)  # captures: not what a step costs
            best = float("inf")
            for _ in range(repeat):
                synchronize(device)
                t0 = time.perf_counter()
                forward(k)
                synchronize(device)
                best = min(best, time.perf_counter() - t0)
            out[f"{b},{k}"] = 1000 * best
        if graphed is not None:
            graphed.release()
        if progress is not None:
            progress((batches.index(b) + 1) / len(batches))
    return out


def engine_step_times(engine, batch: int, max_gamma: int, refresh: bool = False,
                      progress=None) -> dict[tuple[int, int], float]:
    """The engine's T(B, k) for B up to `batch` (powers of two, and `batch`) and k up to max_gamma + 1, measured
    once per machine, model, device, dtype and placement and cached beside the expert profile. progress(done),
    done in [0, 1], is called as each batch size is measured (not when the cache has them)."""
    from moedesk.engine.hardware import on_device
    from moedesk.engine.json_cache import cached_json

    path, batches, graphs = _cache_entry(engine, batch, max_gamma)

    def measure():
        # the chat app measures on a worker thread of its own, whose current GPU is 0 (one GPU named cuda:1)
        with on_device(engine.device):
            return measure_step_times(engine.model, engine.executor, engine.config, engine.device, engine.dtype,
                                      batches, max_gamma + 1, graphs=graphs, progress=progress)

    measured = cached_json(path, measure, refresh)
    return _table(measured)


def cached_step_times(engine, batch: int, max_gamma: int) -> dict[tuple[int, int], float] | None:
    """What `engine_step_times` would return, if it was measured before; None (never measuring) otherwise."""
    import json

    path, _, _ = _cache_entry(engine, batch, max_gamma)
    try:
        return _table(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError, TypeError):
        return None


def _table(measured: dict) -> dict[tuple[int, int], float]:
    return {tuple(int(x) for x in k.split(",")): float(v) for k, v in measured.items()}


def _cache_entry(engine, batch: int, max_gamma: int):
    """(the cache file of these step times, the batches measured, the graphs they are timed through)."""
    import hashlib
    import json
    from pathlib import Path

    from moedesk.engine.hardware import machine_fingerprint
    from moedesk.engine.load.demo import cache_root

    batches = sorted({b for b in MEASURED_BATCHES if b <= batch} | {batch})
    placement = engine.orchestra.summary() if engine.orchestra is not None else {}
    graphs = graphs_like(getattr(engine, "graphs", None))  # as the job's Speculator will run its forwards
    raw = json.dumps([STEP_TIMES_FORMAT, machine_fingerprint(), engine.name, str(engine.device), str(engine.dtype),
                      torch.get_num_threads(), json.dumps(placement, sort_keys=True, default=str), batches,
                      max_gamma + 1, bool(graphs)])
    key = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return Path(cache_root()) / f"speculative-steps-{key}.json", batches, graphs
