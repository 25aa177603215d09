"""Where does a prefill's time go? Issue 41's prefill 512: Qwen3.5-35B-A3B's first 12 layers (Q4_K experts in RAM) and
gpt-oss-120b's first 8 (MXFP4) against llama.cpp on the H200 (docs/measurements.md, session 35); the target is 4x.

Usage (GPU box, repo root): . tests/perf/gpu_env.sh; python3 tests/perf/profile_prefill.py [SHAPE:LAYERS ...]
[--tokens 512] [--expert-format q4_k] [--gpu-budget 0] [--routing no-locality] [--device cpu] [--no-trace]
(default qwen3.5-35b-a3b:12 gpt-oss-120b:8, each in its issue format: MXFP4 for gpt-oss, Q4_K for the others).
Each shape is built, profiled, calibrated and placed as `moedesk bench` does it (bench.synthetic.prepare_synthetic),
then:
1. a warm prefill, three timed ones (tok/s: the best, as `moedesk bench` reports it; each round's ms with its host
   queueing and CPU call) and the executor's counts over them per prefill: experts on the CPU, copied, resident; the
   host's ms in the CPU experts' call, in the wait for the GPU's routing and in the rest of the executor
   (bookkeeping, queueing the GPU's share and the copies);
2. one prefill with marks at each layer's start and end, its token mixer's (attention, sliding attention, Gated
   DeltaNet, MLA) and its experts' (the executor's call): the wall time per layer kind (CUDA events on the GPU,
   so the GPU's timeline, idle gaps included);
   and, from that prefill's own routing, the outlook (engine.offload.prefill_outlook): the split each layer's
   offloaded experts get and its predicted CPU, link and GPU ms beside the measured ones, the time outside the layers'
   expert windows, the bench's bound (every touched expert copied) and the bound with the CPU and the link sharing
   them; --target TOK_S says how much time outside the windows a prefill at that rate may take;
3. one prefill under torch.profiler (CPU and, on a GPU, CUDA activities) with the same marks as ranges: the top ops
   by CUDA time and by self CPU time, the device time inside the experts' ranges split into the experts' copies
   (weights to the GPU), other transfers (the routing and tokens to the host, the CPU's results back) and kernels;
   the trace goes to $OUT/prefill-trace-SHAPE.json.gz.
--compare measures each shape twice on one build: first with a prefill step's copied experts computed one by one and
priced so (as before 2026-11-29, MOEDESK_COPIES_ONE_BY_ONE=1), then in copy runs of one grouped launch each
(engine.offload.assignment.copy_runs); the profiled prefill (step 3) only for the second.
The whole output also goes to $OUT/profile_prefill.txt (OUT unset: the current folder); the short table comes last.
The marks are module hooks and a wrapper around the executor's methods set up here: engine/ has no profiling code.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moedesk.bench.routing import ROUTINGS, replayed
from moedesk.bench.synthetic import measure_prefill, prepare_synthetic
from moedesk.engine.offload.offload_executor import GROUPED_MAX_TOKENS
from moedesk.engine.offload.prefill_outlook import (expected_loads, fixed_ms_for, link_bound_ms, prefill_outlook,
                                                    prefill_outlook_ahead, resident_gpu_ms, shared_bound_ms)

DEFAULT_SHAPES = ("qwen3.5-35b-a3b:12", "gpt-oss-120b:8")
KINDS = ("attention", "sliding", "deltanet", "mla")  # token mixers, the order the tables list them in


def mixer_kind(cfg, layer: int) -> str:
    """The kind of a layer's token mixer, as engine.model.transformer.Block picks it."""
    if cfg.is_linear_layer(layer):
        return "deltanet"
    if cfg.kv_lora_rank:
        return "mla"
    return "sliding" if cfg.is_sliding_layer(layer) else "attention"


def issue_format(shape: str) -> str:
    """Issue 41's expert format for a shape: MXFP4 for gpt-oss (as its checkpoints ship), Q4_K_M's experts otherwise."""
    return "mxfp4" if shape.startswith("gpt-oss") else "q4_k"


class Clock:
    """Time stamps on the GPU's stream (CUDA events: the timeline the work ran on) or, on the CPU, the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


@contextmanager
def marked(model, executor, mark):
    """mark(part, layer, entering) around each layer ("layer"), its token mixer ("mixer"), the executor's call for its
    experts ("experts") and that call's queueing of expert copies ("copies"), for the prefills run inside."""
    handles = []
    for i, block in enumerate(model.layers):
        handles += [block.register_forward_pre_hook(lambda m, a, i=i: mark("layer", i, True)),
                    block.register_forward_hook(lambda m, a, r, i=i: mark("layer", i, False)),
                    block.attn.register_forward_pre_hook(lambda m, a, i=i: mark("mixer", i, True)),
                    block.attn.register_forward_hook(lambda m, a, r, i=i: mark("mixer", i, False))]
    real_outputs, real_copies = executor.expert_outputs, getattr(executor, "_start_copies", None)
    current = [None]  # the layer whose experts are running: _start_copies is not told

    def expert_outputs(moe, *args, **kwargs):
        current[0] = moe.layer
        mark("experts", moe.layer, True)
        try:
            return real_outputs(moe, *args, **kwargs)
        finally:
            mark("experts", moe.layer, False)

    def start_copies(bank, experts, **kwargs):
        mark("copies", current[0], True)
        try:
            return real_copies(bank, experts, **kwargs)
        finally:
            mark("copies", current[0], False)

    executor.expert_outputs = expert_outputs  # instance attributes: the blocks call executor.expert_outputs(...)
    if real_copies is not None:
        executor._start_copies = start_copies
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        del executor.expert_outputs
        if real_copies is not None:
            del executor._start_copies


@contextmanager
def routed(executor):
    """The tokens per expert of each MoE layer the prefills run inside route (the executor's own count, copied)."""
    counts, real = {}, executor._count

    def count(layer, per_expert):
        counts[layer] = per_expert.copy()
        return real(layer, per_expert)

    executor._count = count
    try:
        yield counts
    finally:
        del executor._count


def shape_of(executor, layer: int) -> tuple[int, int]:
    """A layer's experts' (H, F), which decide whether its resident ones run grouped (`resident_grouped`)."""
    host = executor.banks[layer].host
    return host.hidden, host.width


def priced_layers(bench, counts: dict) -> list[tuple[dict[int, int], float]]:
    """Each MoE layer's (offloaded experts' loads, resident ones' GPU ms) from its routing `counts` (`routed`), in
    layer order, priced by the orchestra's latency model as its executor queues them."""
    executor, costs = bench.executor, bench.orchestra.costs
    layers = []
    for layer, per_expert in sorted(counts.items()):
        slots = executor.banks[layer].gpu_slot
        resident = [int(n) for e, n in enumerate(per_expert) if slots[e] is not None]
        offloaded = {e: int(n) for e, n in enumerate(per_expert) if slots[e] is None and n > 0}
        layers.append((offloaded, resident_gpu_ms(resident, costs, GROUPED_MAX_TOKENS, shape_of(executor, layer))))
    return layers


def split_options(executor) -> dict:
    """The outlook's split options as `executor` runs: overlap and copy runs."""
    return {"overlap": executor.overlap_copies, "grouped_copies": executor.copy_runs is not None}


def outlook_of(bench, counts: dict, tokens: int):
    """The prefill predicted from its routing `counts` (`routed`): per layer the offloaded experts' loads and the
    resident ones' GPU time (`priced_layers`), split as its executor runs (overlap, copy runs).
    Returns the outlook, its layers by MoE layer index, and the tokens of every offloaded expert touched."""
    layers = priced_layers(bench, counts)
    outlook = prefill_outlook(layers, bench.orchestra.costs, tokens, fixed_ms=0.0, **split_options(bench.executor))
    return outlook, dict(zip(sorted(counts), outlook.layers)), [n for offloaded, _ in layers for n in offloaded.values()]


def outlook_ahead(bench, counts: dict, tokens: int, fixed_ms: float):
    """The same prefill with each layer's copies for the next made during it (prefetch_ahead), the next layer's
    expected loads read from the calibrated popularity (expected_loads, as ExpertOrchestra.copy_ahead plans them), the
    free staging slots those the layer's own copies leave."""
    executor, costs, popularity = bench.executor, bench.orchestra.costs, bench.orchestra.popularity
    layers, options = priced_layers(bench, counts), split_options(executor)
    top_k = bench.cfg.num_experts_per_tok
    expected = []
    for layer in sorted(counts):
        offloaded = [slot is None for slot in executor.banks[layer].gpu_slot]
        expected.append(expected_loads(popularity[sorted(executor.banks).index(layer)], offloaded, tokens, top_k))
    return prefill_outlook_ahead(layers, expected, costs, tokens, fixed_ms, len(executor.staging), **options)


def executor_copies_ahead(bench) -> bool:
    executors = getattr(bench.executor, "executors", [bench.executor])  # a DeviceOrchestra's, or the one
    return any(getattr(x, "copy_ahead", None) is not None for x in executors)


def say_outlook(outlook, touched: list[int], marked, times, costs, args, say) -> None:
    """The outlook's lines: predicted against measured, what lies outside the expert windows, the two bounds.
    touched: the tokens of every offloaded expert the prefill touched."""
    cpu, copied = outlook.counts()
    windows, wall = outlook.expert_ms, times.wall
    say(f"outlook from this prefill's routing (engine.offload.prefill_outlook): {cpu} experts on the CPU, {copied} "
        f"copied (the executor: {marked.cpu_experts}, {marked.copied_experts}); the CPU's calls {outlook.cpu_ms:.1f} ms "
        f"(measured {marked.cpu_ms:.1f}), the link {outlook.link_ms:.1f} ms, the GPU's sides {outlook.gpu_ms:.1f} ms, "
        f"both at once {outlook.overlap_ms:.1f} ms; the expert windows {windows:.1f} ms (measured calls "
        f"{sum(times.experts.values()):.1f}) of the {wall:.1f} ms prefill, outside them {wall - windows:.1f} ms; link "
        f"busy {100 * outlook.link_ms / wall:.0f}% of the prefill")
    if not touched:  # every expert resident: nothing crosses the link
        return
    link, shared = link_bound_ms(len(touched), costs.copy_expert_ms), shared_bound_ms(touched, costs)
    say(f"bounds on the {len(touched)} offloaded experts it touched: the link alone {link:.1f} ms "
        f"({1e3 * args.tokens / link:.0f} tok/s, the bench's), the CPU and the link sharing them {shared:.1f} ms")
    if args.target:
        say(f"at {args.target:.0f} tok/s a prefill may spend {fixed_ms_for(args.target, args.tokens, windows):.1f} ms "
            f"outside these expert windows ({fixed_ms_for(args.target, args.tokens, shared):.1f} with windows at the "
            f"shared bound); this one spent {wall - windows:.1f}")


def range_name(cfg, part: str, layer: int) -> str:
    """A mark's profiler range: one name per part and mixer kind, so that the tables sum them over the layers."""
    return f"prefill.{mixer_kind(cfg, layer) if part == 'mixer' else part}"


@dataclass
class LayerTimes:
    """One prefill's wall ms per layer: the whole layer, its token mixer, its experts' call (MoE layers); and the
    prefill's own (the model's call, as measure_prefill times it)."""
    wall: float = 0.0
    layer: dict = field(default_factory=dict)
    mixer: dict = field(default_factory=dict)
    experts: dict = field(default_factory=dict)


def time_layers(model, executor, clock: Clock, run) -> LayerTimes:
    """run() (one prefill) with a time stamp at every mark; the ms between each part's marks, per layer."""
    stamps = {}

    def mark(part, layer, entering):
        if part != "copies":  # the copies' queueing is host time, not the stream's: the profiler's ranges show it
            stamps[part, layer, entering] = clock.stamp()

    with marked(model, executor, mark):
        result = run()
    if clock.cuda:
        torch.cuda.synchronize()
    times = LayerTimes(1e3 * result.seconds)
    for (part, layer, entering), start in stamps.items():
        if entering:
            getattr(times, part)[layer] = clock.ms(start, stamps[part, layer, False])
    return times


def kind_split(cfg, times: LayerTimes) -> dict:
    """Per token-mixer kind, and for the layers' feed-forward parts: [layers, ms] summed over the layers.

    "moe": an MoE layer's time outside its token mixer (norm, router, the experts' call, combine, shared expert);
    "experts": of that, the executor's call; "mlp": a dense layer's feed-forward part (DeepSeek's, GLM's first)."""
    split = {}

    def add(key, ms):
        entry = split.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += ms

    for layer, total in sorted(times.layer.items()):
        mixer = times.mixer[layer]
        add(mixer_kind(cfg, layer), mixer)
        if cfg.is_moe_layer(layer):
            add("moe", total - mixer)
            add("experts", times.experts.get(layer, 0.0))
        else:
            add("mlp", total - mixer)
    return split


def _device_kernels(event, copies: bool, out: dict) -> None:
    """Add the device time (µs) of the kernels launched under `event` to out["copies" | "transfers" | "kernels"]:
    copies are the memory copies inside a "prefill.copies" range."""
    for k in event.kernels:
        if k.name == event.name:  # a range's own span on the device's timeline (gpu_user_annotation), not a kernel
            continue
        memory = "Memcpy" in k.name or "Memset" in k.name
        out["copies" if copies and memory else "transfers" if memory else "kernels"] += k.duration
    for child in event.cpu_children:
        _device_kernels(child, copies or child.name == "prefill.copies", out)


def expert_device_ms(events) -> dict:
    """The device ms inside the experts' ranges of a profiled prefill: the experts' copies to the GPU, other
    transfers, and kernels (the resident and copied experts' GEMMs, indexing, the scatter of the results)."""
    out = {"copies": 0.0, "transfers": 0.0, "kernels": 0.0}
    for event in events:
        if event.name == "prefill.experts":
            _device_kernels(event, False, out)
    return {k: v / 1e3 for k, v in out.items()}


def profile_prefill(model, executor, cfg, run, cuda: bool):
    """run() (one prefill) under torch.profiler, every mark a record_function range; the profiler."""
    open_ranges = {}

    def mark(part, layer, entering):
        if entering:
            open_ranges[part, layer] = torch.profiler.record_function(range_name(cfg, part, layer)).__enter__()
        else:
            open_ranges.pop((part, layer)).__exit__(None, None, None)

    acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    with torch.profiler.profile(activities=acts) as prof, marked(model, executor, mark):
        run()
        if cuda:
            torch.cuda.synchronize()
    return prof


@dataclass
class ShapeResult:
    spec: str  # SHAPE:LAYERS, with "/one-by-one" or "/grouped" under --compare
    expert_format: str
    tokens: int
    tok_s: float
    wall_ms: float  # the timed prefill's (best of three)
    stats: dict  # the executor's counts per prefill, StepStats.as_dict over the timed rounds / rounds
    split: dict  # kind_split of the marked prefill
    marked_ms: float  # the marked prefill's wall time
    device: dict | None  # expert_device_ms of the profiled prefill; None without a profile or a GPU


def profile_shape(spec: str, args, say) -> list[ShapeResult]:
    """The shape built once and measured (`measure_shape`): as the engine runs, or under --compare both ways."""
    shape, layers = spec.split(":")
    fmt = args.expert_format or issue_format(shape)
    say(f"\n=== {shape}, first {layers} layers, {fmt} experts, --gpu-budget {args.gpu_budget:g}, prefill "
        f"{args.tokens}")
    bench = prepare_synthetic(shape, int(layers), args.gpu_budget, args.device, args.tokens + 64, args.policy, say,
                              fmt)
    profile = bench.orchestra.profile
    say(f"copies at prefill: each queued with its compute {profile.get('copy_launch_prefill_ms')} ms (by tokens), "
        f"queued alone {profile.get('copy_queue_prefill_ms')} ms; CPU calls of {profile.get('cpu_prefill_experts')} "
        f"experts {profile.get('cpu_prefill_ms')} ms, path {profile.get('cpu_path')}")
    # A trace step a prefill (warm, three timed, marked, profiled), as the bench gives each of its rounds one
    with replayed(bench.model, bench.cfg, sorted(bench.banks), args.routing, args.tokens, 6):
        if not args.compare:
            results = [measure_shape(spec, fmt, bench, args, say, trace=not args.no_trace)]
        else:
            results = []
            for grouped in (False, True):
                bench.orchestra.group_copies(grouped)
                say(f"\n--- {'grouped: one launch a copy run' if grouped else 'one by one: as before'}")
                results.append(measure_shape(f"{spec}/{'grouped' if grouped else 'one-by-one'}", fmt, bench, args,
                                             say, trace=grouped and not args.no_trace))
    device = bench.device
    del bench
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def measure_shape(spec: str, fmt: str, bench, args, say, trace: bool) -> ShapeResult:
    """Steps 1-3 of the module docstring on a built shape."""
    shape = spec.split(":")[0]
    model, executor, cfg, device, dtype = bench.model, bench.executor, bench.cfg, bench.device, bench.dtype
    clock = Clock(device)

    def prefill(repeat: int = 1):
        return measure_prefill(model, executor, cfg, device, dtype, args.tokens, repeat=repeat)

    prefill()  # warm: the kernels' first calls, the executor's buffers at this size
    executor.stats = type(executor.stats)()
    rounds = []
    for _ in range(3):  # one at a time, so that a round which stalls shows with its own host times
        before = executor.stats.copy()
        rounds.append((prefill().seconds, executor.stats.since(before)))
    best = min(seconds for seconds, _ in rounds)
    per_run = {k: v / len(rounds) if isinstance(v, (int, float)) and k != "gpu_hit_rate" else v
               for k, v in executor.stats.as_dict().items()}
    say(f"prefill {args.tokens}: {args.tokens / best:.0f} tok/s (best of {len(rounds)}, {1e3 * best:.1f} ms); per "
        f"prefill {per_run['experts_cpu']:.0f} experts on the CPU, {per_run['experts_copied']:.0f} copied, "
        f"{per_run['experts_gpu']:.0f} resident; host ms in the executor {per_run['moe_ms']:.2f}: the CPU experts' "
        f"call {per_run['cpu_expert_ms']:.2f}, the wait for the GPU's routing {per_run['gpu_wait_ms']:.2f}, the rest "
        f"{per_run['moe_ms'] - per_run['cpu_expert_ms'] - per_run['gpu_wait_ms']:.2f} (below 0 where the CPU's call "
        f"ran beside the copies' queueing)")
    say("the rounds, ms: " + ", ".join(f"{1e3 * seconds:.1f} (queueing {st.queue_ms:.1f}, CPU call {st.cpu_ms:.1f})"
                                      for seconds, st in rounds))

    before = executor.stats.copy()
    with routed(executor) as counts:
        times = time_layers(model, executor, clock, prefill)
    marked = executor.stats.since(before)
    outlook, predicted, touched = outlook_of(bench, counts, args.tokens) if args.policy == "balanced" else (None, {}, [])
    split = kind_split(cfg, times)
    say(f"\nmarked prefill, wall ms per part ({'CUDA events' if clock.cuda else 'host clock'}): {times.wall:.2f} ms, "
        f"its layers {sum(times.layer.values()):.2f}; predicted: each MoE layer's CPU call, GPU side and copies")
    say(f"{'layer':>5} {'mixer':<10}{'mixer ms':>9}{'ffn ms':>8}{'experts':>8}{'cpu':>7}{'gpu':>7}{'copies':>7}")
    for layer, total in sorted(times.layer.items()):
        mixer = times.mixer[layer]
        experts = f"{times.experts[layer]:8.2f}" if layer in times.experts else f"{'-':>8}"
        guess = predicted.get(layer)
        guess = f"{guess.cpu_ms:7.2f}{guess.gpu_ms:7.2f}{guess.copies:7d}" if guess else ""
        say(f"{layer:>5} {mixer_kind(cfg, layer):<10}{mixer:9.2f}{total - mixer:8.2f}{experts}{guess}")
    if outlook:
        say_outlook(outlook, touched, marked, times, bench.orchestra.costs, args, say)
        if clock.cuda:  # the simulated tier copies synchronously: nothing to make ahead
            ahead = outlook_ahead(bench, counts, args.tokens, times.wall - outlook.expert_ms)
            cpu, copied = ahead.counts()
            runs = "what runs" if executor_copies_ahead(bench) else "not what runs: MOEDESK_COPY_AHEAD=1 runs it"
            early = round(sum(x.ahead_link_ms for x in ahead.layers) / bench.orchestra.costs.copy_expert_ms)
            say(f"with copies a layer ahead (prefetch_ahead on the calibrated popularity; {runs}): "
                f"{ahead.tok_s:.0f} tok/s predicted against {ahead.tokens * 1e3 / times.wall:.0f} measured, windows "
                f"{ahead.expert_ms:.1f} ms, {cpu} experts on the CPU, {copied} copied in their layer, link busy "
                f"{100 * ahead.link_busy:.0f}%, {early} copied ahead (the executor: {marked.ahead_copied}, "
                f"{marked.ahead_used} of them routed a token)")

    device_ms = None
    if trace:
        prof = profile_prefill(model, executor, cfg, prefill, clock.cuda)
        os.makedirs(args.out, exist_ok=True)
        trace = os.path.join(args.out, f"prefill-trace-{shape}.json.gz")
        prof.export_chrome_trace(trace)
        averages = prof.key_averages()
        if clock.cuda:
            say(f"\nprofiled prefill: top ops by CUDA time (trace in {trace})")
            say(averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=48))
        say("profiled prefill: top ops by self CPU time")
        say(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
        if clock.cuda:
            device_ms = expert_device_ms(prof.events())
            say("device ms inside the experts' calls: " + ", ".join(f"{k} {v:.2f}" for k, v in device_ms.items()))
    return ShapeResult(spec, fmt, args.tokens, args.tokens / best, 1e3 * best, per_run, split, times.wall, device_ms)


SUMMARY_COLUMNS = ("shape", "format", "tok/s", "ms", *KINDS, "mlp", "moe", "experts", "cpu", "wait", "copies",
                   "gpu", "other")


def summary_row(r: ShapeResult) -> dict:
    """One shape's row of the last table: ms of the whole prefill per part (not per layer); None where the shape has
    no such part. cpu and wait: the host's ms in the CPU experts' call and in the wait for the routing (executor
    counts); copies and gpu: device ms of the experts' copies and kernels (profiler); other: the marked prefill's
    wall time outside its layers (the embedding, the head, the gap before the first layer's work)."""
    ms = {k: v[1] for k, v in r.split.items()}
    layers = sum(v for k, v in ms.items() if k not in ("experts",))
    row = {"shape": r.spec, "format": r.expert_format, "tok/s": r.tok_s, "ms": r.wall_ms,
           **{k: ms.get(k) for k in (*KINDS, "mlp", "moe", "experts")},
           "cpu": r.stats["cpu_expert_ms"], "wait": r.stats["gpu_wait_ms"],
           "copies": r.device["copies"] if r.device else None, "gpu": r.device["kernels"] if r.device else None,
           "other": r.marked_ms - layers}
    return row


def format_summary(rows: list[dict]) -> list[str]:
    """The last table: text columns left-aligned, figures right-aligned, "-" for a part the shape lacks."""
    width = {c: max(20, 2 + max((len(row["shape"]) for row in rows), default=0)) if c == "shape"
             else max(8, len(c) + 1) for c in SUMMARY_COLUMNS}

    def cell(c, v):
        if c in ("shape", "format"):
            return f"{v:<{width[c]}}"
        return f"{'-':>{width[c]}}" if v is None else f"{v:>{width[c]}.{0 if c == 'tok/s' else 2}f}"

    head = "".join(f"{c:<{width[c]}}" if c in ("shape", "format") else f"{c:>{width[c]}}" for c in SUMMARY_COLUMNS)
    return [head] + ["".join(cell(c, row[c]) for c in SUMMARY_COLUMNS) for row in rows]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES), metavar="SHAPE:LAYERS")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens a prefill takes")
    parser.add_argument("--expert-format", default=None,
                        help="every shape's experts in this format (default: mxfp4 for gpt-oss, q4_k otherwise)")
    parser.add_argument("--gpu-budget", type=float, default=0.0, help="GiB, as `moedesk bench --gpu-budget` (0: every "
                        "expert in RAM)")
    parser.add_argument("--policy", default="balanced")
    parser.add_argument("--routing", choices=list(ROUTINGS), default="model",
                        help="as `moedesk bench --routing`: the random weights' routers, or a replayed trace")
    parser.add_argument("--device", default="auto", help="cpu: the script itself on a tiny shape, no CUDA activity")
    parser.add_argument("--rows", type=int, default=15, help="rows of each profiler table")
    parser.add_argument("--no-trace", action="store_true", help="no profiled prefill (no tables, no trace)")
    parser.add_argument("--target", type=float, default=0.0, help="tok/s: the time outside the expert windows a "
                        "prefill at this rate may take (issue 42's Mixtral target, 4x llama.cpp's prefill: docs/measurements.md)")
    parser.add_argument("--compare", action="store_true", help="each shape's copies one by one (as before), then in "
                        "copy runs of one grouped launch, on one build")
    args = parser.parse_args(argv)
    args.out = os.environ.get("OUT") or "."
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_prefill.txt"), "w") as report:
        def say(text: str = "") -> None:
            print(text, flush=True)
            report.write(text + "\n")
            report.flush()

        results = [result for spec in args.shapes for result in profile_shape(spec, args, say)]
        rows = [summary_row(r) for r in results]
        say(f"\nprefill {args.tokens}, ms of one prefill: per token mixer kind and feed-forward part (marked prefill), "
            f"in the experts' call; cpu / wait: host ms in the CPU experts' call / the wait for the routing; copies / "
            f"gpu: device ms of the experts' copies / kernels (profiled prefill)")
        for line in format_summary(rows):
            say(line)
    return rows


if __name__ == "__main__":
    main()
