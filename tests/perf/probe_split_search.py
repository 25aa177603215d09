"""What a prefill's split search costs the host: the one-pass split (assignment._equal_gpu_split) against the greedy
search it replaced for copy runs, on one build, so both see the same profile, placement and routing.

Usage (GPU box, repo root): . tests/perf/gpu_env.sh; python3 tests/perf/probe_split_search.py [SHAPE:LAYERS:FORMAT ...]
[--rounds N] [--tokens N] [--device cpu] (default qwen3.5-35b-a3b:12:q4_k gpt-oss-120b:8:mxfp4; every expert in RAM,
as `moedesk bench --gpu-budget 0`). Per round, a prefill with each search, alternating, so drift hits both alike; the greedy one
is the prefix splits and single moves of `_greedy` (without Fiddler's candidate, which the one-pass split never
loses to). Prints per search the median and best ms of a prefill, and per prefill the host ms in `decide`, the
executor's queueing (decide included) and its MoE layers, and the experts copied and on the CPU.
"""
import argparse
import statistics
import time

from moedesk.bench.synthetic import measure_prefill, prepare_synthetic
from moedesk.engine.offload import assignment

REPEAT = 2  # prefills a measurement: its best is the figure; the host's counts, summed over them, are divided
parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="*", default=["qwen3.5-35b-a3b:12:q4_k", "gpt-oss-120b:8:mxfp4"])
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--device", default="cuda", help="cpu: the script itself on a tiny shape (tiny-qwen35:4:q4_k)")
args = parser.parse_args()

one_pass = assignment._equal_gpu_split


def greedy(groups):
    return assignment._greedy(groups, [0] * len(groups.ids))


rows = []
for spec in args.shapes:
    shape, layers, fmt = spec.split(":")
    bench = prepare_synthetic(shape, int(layers), 0.0, args.device, args.tokens + 64, "balanced", print, fmt)
    model, executor, cfg, device, dtype = bench.model, bench.executor, bench.cfg, bench.device, bench.dtype
    decide = executor.decide  # a RememberedSplit: a prefill's loads are new each layer, so each is searched
    spent = [0.0]

    def timed(loads):
        start = time.perf_counter()
        try:
            return decide(loads)
        finally:
            spent[0] += time.perf_counter() - start

    executor.decide = timed
    results = {"one pass": [], "greedy": []}
    for r in range(args.rounds + 1):
        for name, search in (("one pass", one_pass), ("greedy", greedy)):
            assignment._equal_gpu_split = search
            decide.memory.clear()
            executor.stats, spent[0] = type(executor.stats)(), 0.0
            ms = 1e3 * measure_prefill(model, executor, cfg, device, dtype, args.tokens, seed=r, repeat=REPEAT).seconds
            s = executor.stats
            summed = (1e3 * spent[0], s.queue_ms, s.layer_ms, s.copied_experts, s.cpu_experts)
            if r:  # round 0 warms each search's kernels and buffers
                results[name].append((ms, *(x / REPEAT for x in summed)))
    assignment._equal_gpu_split = one_pass
    for name, got in results.items():
        ms = [g[0] for g in got]
        mean = [statistics.fmean(g[i] for g in got) for i in range(1, 6)]
        rows.append((spec, name, statistics.median(ms), min(ms), *mean))
    del bench, model, executor

print(f"\n{'shape':<26}{'search':<10}{'median ms':>10}{'best':>8}{'decide':>8}{'queue':>8}{'MoE':>8}"
      f"{'copied':>8}{'CPU':>6}")
for spec, name, med, best, dec, queue, moe, copied, cpu in rows:
    print(f"{spec:<26}{name:<10}{med:>10.2f}{best:>8.2f}{dec:>8.2f}{queue:>8.2f}{moe:>8.2f}{copied:>8.0f}{cpu:>6.0f}")
