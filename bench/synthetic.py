"""`moedesk bench`: decode, prefill and batched decode on synthetic models of real shapes.

Each figure comes with the bound the measured bandwidths allow for the same placement, so a
result reads as "% of what this machine could do", not only as tokens per second.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moedesk.bench.feed import experts_touched, fed_tokens, selection_counts
from moedesk.bench.kernel_builds import recorded_builds
from moedesk.bench.machine_load import CpuLoad, busy_warning
from moedesk.bench.report_text import profile_line, significant, text_table
from moedesk.engine.generation.decoder import Decoder
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.offload.assignment import lone_token_split
from moedesk.engine.offload.devices import format_device_plan
from moedesk.engine.requests import Request, SamplingParams


@dataclass
class BenchResult:
    mode: str  # decode | prefill | batched_decode
    tokens: int  # prompt tokens for prefill, generated tokens otherwise
    batch: int
    seconds: float
    tok_s: float
    bound_tok_s: float | None = None
    depth: int = 0  # tokens of context already in the cache when the run starts (bench.depth)
    spread: float | None = None  # (slowest - fastest) / median over its rounds: decode steps, prefill repeats
    noise: float | None = None  # standard error of the mean step time over the decode steps, relative to it
    rounds: int = 1  # runs the figure is the best of (prefill); the executor's counts cover them all
    experts: dict | None = None  # where the offloaded experts ran, summed over the rounds (StepStats.as_dict)
    feed: str | None = None  # decode: what each step fed, "random" tokens (as llama-bench) or "greedy" (its own)
    experts_touched: int | None = None  # decode: (layer, expert) pairs the timed steps selected at least once
    slowest: dict | None = None  # its slowest rounds and its median one (`slowest`): where a stall was
    kernel_builds: dict | None = None  # Triton's builds inside the timed rounds (bench.kernel_builds): a stall's cause

    @property
    def pct_of_bound(self) -> float | None:
        return None if not self.bound_tok_s else 100 * self.tok_s / self.bound_tok_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pct_of_bound"] = None if self.pct_of_bound is None else round(self.pct_of_bound, 1)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure_decode(model, executor, cfg, device, dtype, batch: int, new_tokens: int = 64, prompt: int = 32,
                   seed: int = 0, graphs: bool | None = None, warmup: int = 1, feed: str = "random") -> BenchResult:
    """Generated tokens per second over all sequences, timed from decode step `warmup` + 1 to the last.

    The first decode step is left out: it captures the CUDA graphs (graphs None: where the engine
    would use them), which a chat pays once per batch size, not per token. A larger `warmup` leaves out
    more (a cache's first steps of a conversation). The executor's stats restart where the timing
    starts, so they cover exactly the timed steps. feed: what each step feeds (fed_tokens), through the
    decoder's own step either way: the model still computes and chooses its token, which is then replaced.
    """
    if warmup < 1 or (warmup > 1 and warmup > new_tokens - 2):
        raise ValueError(f"warmup {warmup}: at least the first decode step, and a step left to time of {new_tokens}")
    from moedesk.engine.generation.cuda_graphs import graphs_wanted

    use_graphs = graphs_wanted(torch.device(device)) if graphs is None else graphs
    runner = ModelRunner(model, device, dtype, prompt + new_tokens + 1, graphs=use_graphs)
    runner.reserve(batch, prompt + new_tokens + 1)
    decoder = Decoder(runner, executor, None)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [Request(random_prompt(prompt, cfg.vocab_size, seed + i), params,
                        fed_tokens=fed_tokens(feed, new_tokens, cfg.vocab_size, seed + i)) for i in range(batch)]
    start, before = None, None
    step_ends = []  # when each timed step's last row came out: the steps' times are the rounds' spread
    with recorded_builds() as builds:
        for seq, token in decoder.run(requests, batch_size=batch):
            if start is None and len(seq.tokens) == 1 + warmup and seq.row == batch - 1:
                _sync(device)
                if hasattr(executor, "stats"):
                    executor.stats = type(executor.stats)()
                before = selection_counts(executor)
                start = time.perf_counter()  # every sequence has 1 + warmup tokens: the untimed steps are done
                step_ends.append(start)
            elif start is not None and seq.row == batch - 1:
                step_ends.append(time.perf_counter())
        _sync(device)
    seconds = time.perf_counter() - start
    generated = batch * (new_tokens - 1 - warmup)
    steps = [b - a for a, b in zip(step_ends, step_ends[1:])]
    return BenchResult("decode" if batch == 1 else "batched_decode", new_tokens, batch, seconds, generated / seconds,
                       spread=spread(steps), noise=noise(steps), feed=feed, slowest=slowest(steps),
                       experts_touched=experts_touched(executor, before), kernel_builds=builds.since(start))


def measure_prefill(model, executor, cfg, device, dtype, length: int, seed: int = 0, repeat: int = 2) -> BenchResult:
    cache = model.new_cache(1, length, dtype, device)
    tokens = torch.tensor([random_prompt(length, cfg.vocab_size, seed)], device=device)
    positions = torch.arange(length, device=device)[None]
    last = torch.tensor([length - 1], device=device)
    times = []
    with recorded_builds() as builds:
        for _ in range(repeat):
            _sync(device)
            start = time.perf_counter()
            model(tokens, positions, cache, executor, logits_at=last)
            _sync(device)
            times.append(time.perf_counter() - start)
    best = min(times)
    return BenchResult("prefill", length, 1, best, length / best, spread=spread(times), rounds=repeat,
                       slowest=slowest(times), kernel_builds=builds.since(0.0))


def spread(times: list[float]) -> float | None:
    """(slowest - fastest) / median of a run's rounds; None for fewer than two."""
    if len(times) < 2:
        return None
    ordered = sorted(times)
    middle = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                 + ordered[len(ordered) // 2]) / 2
    return (ordered[-1] - ordered[0]) / middle if middle > 0 else None


def slowest(times: list[float], count: int = 3) -> dict | None:
    """A run's `count` slowest rounds as [round (from 0), ms], slowest first, beside its median round's ms: which
    round a large spread came from. None for fewer than two rounds."""
    if len(times) < 2:
        return None
    order = sorted(range(len(times)), key=lambda i: -times[i])[:count]
    return {"median_ms": round(1e3 * statistics.median(times), 2),
            "rounds": [[i, round(1e3 * times[i], 2)] for i in order]}


def stall_line(result: dict) -> str | None:
    """A line for a run whose slowest round took more than twice its median one (a stall, not noise); else None."""
    worst = result.get("slowest")
    if not worst or not worst["median_ms"]:
        return None
    (index, ms), median = worst["rounds"][0], worst["median_ms"]
    if ms <= 2 * median:
        return None
    unit = "prefill" if result["mode"] == "prefill" else "step"
    built = result.get("kernel_builds")
    cause = (f"; Triton built {built['count']} kernel variants in the timed {unit}s, {significant(built['ms'])} ms "
             f"({', '.join(built['kernels'])})") if built else ""
    return (f"{result['mode'].replace('_', ' ')}: timed {unit} {index + 1} took {significant(ms)} ms, "
            f"{ms / median:.1f}x the median {unit}'s {significant(median)} ms{cause}")


def noise(times: list[float]) -> float | None:
    """Standard error of the mean of a run's rounds, relative to the mean: how far its rate may be off by chance
    (two runs' ratio: the square root of the sum of their squares). None for fewer than two."""
    if len(times) < 2:
        return None
    mean = sum(times) / len(times)
    var = sum((t - mean) ** 2 for t in times) / (len(times) - 1)
    return (var / len(times)) ** 0.5 / mean if mean > 0 else None


def traffic_bound(stats, steps: int, tokens_per_step: int, expert_bytes: int, bytes_per_s: float) -> float | None:
    """Tokens/s if a step took only the time to read its offloaded experts at `bytes_per_s`.

    stats: the executor's StepStats over `steps` steps; every offloaded expert a step computed (on the
    CPU, copied, or read zero-copy by the GPU) counts once, which is the routing the run really had, not a
    calibration estimate. None when no step read an offloaded expert.
    """
    offloaded = (stats.cpu_experts + stats.copied_experts + stats.zero_copy_experts) / steps
    return tokens_per_step * bytes_per_s / (offloaded * expert_bytes) if offloaded else None


@dataclass
class BenchModel:
    """A model profiled, calibrated and placed as the app would place it: what every `moedesk bench` measurement runs
    on. A synthetic one of a real shape (`prepare_synthetic`), or a model file the engine loaded (`prepare_file`)."""
    shape: str
    cfg: object
    model: object
    banks: dict
    orchestra: object
    device: torch.device
    dtype: torch.dtype
    policy: str
    gpu_budget_gib: float | tuple[float, ...]  # several: one per GPU, the layers spread over them
    experts_on_gpu: int
    whole_layers_on_gpu: int
    budget_split: dict | None = None  # bytes of the budget per use (bench.budget); None: every expert in RAM
    format_notes: tuple[str, ...] = ()  # projections stored in another format than asked (format_fallbacks)

    @property
    def expert_budget(self) -> int:
        """Bytes of the budget left to resident experts once the weights, cache and workspace are counted."""
        return self.budget_split["experts"] if self.budget_split else 0

    @property
    def executor(self):
        return self.orchestra.executor

    @property
    def profile(self) -> dict:
        return self.orchestra.profile

    def header(self) -> dict:
        """The fields every bench report starts with."""
        return {"shape": self.shape, "layers": self.cfg.num_layers, "gpu_budget_gib": self.gpu_budget_gib,
                "device": str(self.device), "dtype": str(self.dtype),
                "experts": next(iter(self.banks.values())).describe(), "policy": self.policy,
                "experts_on_gpu": self.experts_on_gpu, "whole_layers_on_gpu": self.whole_layers_on_gpu,
                "popularity_evenness": round(self.orchestra.evenness, 4), "threads": torch.get_num_threads(),
                "lone_token_split": self.lone_token_split(), "format_notes": list(self.format_notes),
                **({"budget_split_bytes": self.budget_split} if self.budget_split else {}),
                **({"devices": self.orchestra.device_lines()} if hasattr(self.orchestra, "device_lines") else {})}

    def lone_token_split(self) -> dict:
        """How decode of one token shares the offloaded experts with the GPU (engine.offload.assignment
        .lone_token_split: whole experts, or the last part of every expert's width), as the profile decided it."""
        ranks, width = lone_token_split(self.orchestra.top_k, self.orchestra.costs) if self.policy == "balanced" \
            else (0, 0)
        return {"gpu_experts": ranks, "gpu_width": width}


def _check_fits(cfg, shape: str, dtype: torch.dtype, expert_format: str, on_cuda: bool) -> None:
    """Refuse, in one line naming a --layers that fits, a model the RAM cannot hold (with a GPU: its experts)."""
    import psutil

    from moedesk.engine.memory_fit import check_bench_fits
    from moedesk.kernels.quant_formats import FORMATS

    element = torch.empty((), dtype=dtype).element_size()
    bits = 8 * element if expert_format == "dense" else FORMATS[expert_format].bits_per_weight()
    check_bench_fits(cfg, cfg.num_layers, 0 if on_cuda else element, bits, psutil.virtual_memory().available, shape)


def prepare_synthetic(shape: str, layers: int | None, gpu_budget_gib: float | tuple[float, ...], device="auto",
                      context: int = 4096, policy: str = "balanced", log=print,
                      expert_format: str = "dense", reprofile: bool = True, calibration=None,
                      feed: str = "random") -> BenchModel:
    """Build the synthetic model with room for `context` positions, profile, calibrate and place its experts.

    gpu_budget_gib: the whole GPU's, as a user's --gpu-budget: the non-expert weights, one sequence's KV cache of
    `context` positions, a prefill piece's workspace and slack come out of it first (bench.budget), the experts get
    the rest; a budget too small for the first part is refused before the model is built. 0: every expert in RAM.
    Several figures: one per GPU (cuda:0, cuda:1, ...; on the CPU the CPU repeated), each that GPU's whole budget as
    the engine's per-device plan counts it (its layers' weights, their KV cache of `context` positions, then its hot
    experts; engine.offload.devices): the layers run spread over the GPUs (engine.model.layer_devices).
    expert_format: the experts' storage, "dense" (16-bit on the GPU box) or a packed format of
    kernels.quant_formats (q4_0, q8_0, q4_k, q5_k, q6_k, mxfp4).
    reprofile False: a profile this machine stored for the same shape and experts (an earlier bench's) is used.
    calibration: two halves of selections per [MoE layer, expert] to calibrate popularity from, in place of the
    calibration decodes (a bench that replays a routing trace: tests/perf/bench_expert_cache.py).
    feed: what the calibration decodes feed (bench.feed.fed_tokens): the measured runs' feed, so that popularity
    is learned from the routing they will see."""
    from moedesk.bench.budget import bench_dtype, bench_split
    from moedesk.engine.generation.scheduler import default_prefill_chunk
    from moedesk.engine.hardware import use_device
    from moedesk.engine.load.demo import cache_root
    from moedesk.engine.offload.orchestration import ExpertOrchestra, leave_a_core_to_the_gpu_thread
    from moedesk.engine.load.synthetic import format_fallbacks, packed_plan, shape_config, synthetic_model

    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          ("cpu" if device == "auto" else device))
    budgets = tuple(gpu_budget_gib) if isinstance(gpu_budget_gib, (tuple, list)) and len(gpu_budget_gib) > 1 else None
    if isinstance(gpu_budget_gib, (tuple, list)) and not budgets:
        gpu_budget_gib = gpu_budget_gib[0]
    devices = _bench_devices(device, len(budgets)) if budgets else None
    device = devices[0] if budgets else device
    on_cuda = device.type == "cuda"
    if on_cuda:
        leave_a_core_to_the_gpu_thread()
        use_device(device)  # the bench measures on this thread: --device cuda:1 alone launches Triton there
    dtype = bench_dtype(device)
    cfg = shape_config(shape, layers)
    context = max(context, 32 + 16 + 1)  # the calibration below decodes 16 tokens past 32-token prompts
    split = bench_split(cfg, int(gpu_budget_gib * 2**30), context, dtype, default_prefill_chunk(device),
                        expert_format, device) \
        if not budgets and gpu_budget_gib > 0 else None
    _check_fits(cfg, shape, dtype, expert_format, on_cuda)
    t0 = time.perf_counter()
    model, banks = synthetic_model(cfg, dtype, device, pinned=on_cuda, context=context, expert_format=expert_format)
    log(f"built {shape} x{cfg.num_layers} layers, experts {next(iter(banks.values())).describe()}, "
        f"in {time.perf_counter() - t0:.1f}s")
    notes = tuple(format_fallbacks(expert_format, cfg.hidden_size, cfg.moe_intermediate_size))
    for note in notes:
        log(note)
    # A benchmark measures afresh every run (reprofile), and stores it like a real model's profile. Said first:
    # on a slow or busy CPU it takes minutes.
    log("profiling one expert's latency and the copies to the GPU..." if reprofile else
        "the profile stored for this shape and these experts, or measured now if there is none...")
    shape_key = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, str(dtype))
    if budgets:
        from moedesk.engine.model.layer_devices import spread_model
        from moedesk.engine.offload.device_orchestra import DeviceOrchestra

        sizes = _device_sizes(cfg, dtype, context, budgets, banks, packed_plan(cfg, expert_format, device=device))
        owner = spread_model(model, devices, _owner(budgets, banks, sizes)).device_of_layer
        orchestra = DeviceOrchestra.start(banks, devices, owner, ("bench", shape_key), cache_root(), reprofile,
                                          policy=policy, top_k=cfg.num_experts_per_tok, dtype=dtype)
    else:
        orchestra = ExpertOrchestra.start(banks, device, ("bench", shape_key), cache_root(), reprofile=reprofile,
                                          policy=policy, top_k=cfg.num_experts_per_tok, dtype=dtype)
    profile, executor = orchestra.profile, orchestra.executor
    for part, d in zip(getattr(orchestra, "parts", [orchestra]), getattr(orchestra, "device_of_part", [None])):
        log(profile_line(part.profile) if d is None else f"GPU {d}: {profile_line(part.profile)}")

    # Popularity as the app calibrates a real model (engine.offload.calibration): two halves of prompts, each
    # prefilled and decoded for a few tokens, all experts on the CPU. Seeds apart from the measured runs'.
    halves = calibration or []
    for seed in () if calibration else (1000, 2000):
        executor.selections.clear()
        measure_decode(model, executor, cfg, device, dtype, 4, new_tokens=16, prompt=32, seed=seed, feed=feed)
        halves.append([executor.selections[layer].tolist() for layer in sorted(banks)])
    orchestra.calibrate(halves)
    parts = None
    if split is not None:
        parts = {name: getattr(split, name) for name in ("weights", "kv_cache", "workspace", "slack", "experts")}
        log(f"budget at {context} positions: {_split_text(parts)}")
    if budgets:
        for line in format_device_plan(_place_devices(orchestra, budgets, sizes), orchestra.popularity):
            log(line)
        on_gpu = executor.on_gpu()
    else:
        on_gpu = orchestra.place(split.experts if split else 0).as_lists()
    resident = sum(map(sum, on_gpu))
    whole = sum(all(row) for row in on_gpu)
    log(f"placement: {resident} of {len(banks) * cfg.num_experts} experts on the GPU, {whole} whole layers "
        f"({policy} policy, popularity {100 * orchestra.evenness:.0f}% even); "
        f"in the decode graphs: {sum(map(executor.runs_on_device, sorted(banks)))} layers")
    return BenchModel(shape, cfg, model, banks, orchestra, device, dtype, policy, gpu_budget_gib, resident, whole,
                      parts, notes)


def prepare_file(path: str, gpu_budget_gib: float, device="auto", context: int = 4096, log=print) -> BenchModel:
    """A model file (a GGUF, or a checkpoint folder) loaded by the native engine as the app loads it: profiled,
    calibrated on the calibration prompts and placed within `gpu_budget_gib` (the whole GPU's, as --gpu-budget), with
    room for `context` positions. Its routers are the file's: llama-bench on the same file picks the same experts
    for the same tokens, which two random models of one shape do not (tests/perf/families_vs_llamacpp.sh)."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.runtime import Engine

    t0 = time.perf_counter()
    engine = Engine.load(path, engine="native", device=device, context_length=context, gpu_budget=gpu_budget_gib,
                         offload=True, reprofile=True)
    if engine.orchestra is None:
        raise MoedeskError(f"bench --gguf {path}: {engine.config.arch} has no routed experts to place")
    executor = engine.executor
    banks = {layer: bank.host for layer, bank in executor.banks.items()}  # each MoE layer's experts in RAM
    on_gpu = executor.on_gpu()
    resident, whole = sum(map(sum, on_gpu)), sum(all(row) for row in on_gpu)
    log(f"loaded {Path(path).name} ({engine.config.arch} x{engine.config.num_layers} layers, experts "
        f"{next(iter(banks.values())).describe()}) in {time.perf_counter() - t0:.1f}s; {resident} of "
        f"{len(banks) * engine.config.num_experts} experts on the GPU, {whole} whole layers")
    return BenchModel(Path(path).name, engine.config, engine.model, banks, engine.orchestra, engine.device,
                      engine.dtype, "balanced", gpu_budget_gib, resident, whole)


def _bench_devices(device: torch.device, count: int) -> list[torch.device]:
    """The devices several budget figures stand for: the CUDA GPUs in order, or the CPU repeated (simulated)."""
    from moedesk.engine.errors import MoedeskError

    if device.type == "cpu":
        return [device] * count
    if torch.cuda.device_count() < count:
        raise MoedeskError(f"--gpu-budget names {count} GPUs and this machine has {torch.cuda.device_count()}")
    return [torch.device("cuda", i) for i in range(count)]


def _device_sizes(cfg, dtype: torch.dtype, context: int, budgets, banks, packed: dict | None = None) -> tuple:
    """engine.offload.devices.layer_sizes at one sequence of `context` positions (the bench's), the MoE layers
    being those with banks; packed: the non-expert weights synthetic_model keeps packed, counted packed."""
    from moedesk.engine.offload.devices import layer_sizes

    weights, kv, _, first, last = layer_sizes(cfg, dtype.itemsize, context, len(budgets), packed)
    return weights, kv, [layer in banks for layer in range(cfg.num_layers)], first, last


def _owner(budgets, banks, sizes) -> tuple[int, ...]:
    from moedesk.engine.offload.devices import layer_owner

    bank = next(iter(banks.values()))
    return layer_owner([int(b * 2**30) for b in budgets], bank.expert_bytes, bank.num_experts, *sizes)


def _place_devices(orchestra, budgets, sizes):
    """The per-device plan over the calibrated popularity, each device priced by its own profile; placed."""
    from moedesk.engine.offload.devices import plan_devices
    from moedesk.engine.offload.placement import LayerCosts

    costs = [None] * len(budgets)
    for part, d in zip(orchestra.parts, orchestra.device_of_part):
        costs[d] = None if part.cache else LayerCosts.from_model(part.costs, part.executor.whole_layers_on_device,
                                                                 splits_lone_tokens=part.executor.splits_lone_tokens)
    plan = plan_devices([int(b * 2**30) for b in budgets], orchestra.expert_bytes, len(orchestra.popularity[0]),
                        orchestra.popularity, *sizes, layer_costs=costs, top_k=orchestra.top_k)
    orchestra.place_plan(plan)
    return plan


def _split_text(split: dict) -> str:
    return ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in split.items())


def bench_context(prefill: tuple[int, ...] = (512, 2048), decode_tokens: int = 64, contexts: tuple[int, ...] = (),
                  context_chunk: int = 512) -> int:
    """Positions `run_bench` builds its model and cache for: the longest prefill (256 at least) then a decode run,
    or the deepest context's run (bench.depth.depth_context)."""
    from moedesk.bench.depth import depth_context

    return max(max(prefill + (256,)) + decode_tokens, depth_context(max(contexts, default=0), decode_tokens,
                                                                    context_chunk))


def run_bench(shape: str, layers: int | None, gpu_budget_gib: float | tuple[float, ...], device="auto",
              decode_tokens: int = 64, prefill: tuple[int, ...] = (512, 2048), batch: int = 16,
              policy: str = "balanced", log=print,
              expert_format: str = "dense", contexts: tuple[int, ...] = (), context_chunk: int = 512,
              feed: str = "random", routing: str = "model", model_file: str | None = None) -> dict:
    """Build the synthetic model, profile, place, measure; return every figure and its bound.

    model_file: a GGUF or checkpoint folder loaded by the native engine in its place (`prepare_file`; shape, layers,
    policy, expert_format and routing are the file's and the engine's then).

    feed: what every decode step feeds, calibration's included (bench.feed.fed_tokens): "random" tokens, as
    llama-bench does, or "greedy", the model's own choice.
    routing: what routes the plain decode and prefill runs and calibrates popularity (bench.routing): "model", its
    own routers, or a replayed trace, "no-locality" or "conversation".

    contexts: depths at which decode and a prefill piece of `context_chunk` tokens are measured again after that
    many tokens of context (bench.depth). The budget counts the KV cache of the whole context built (bench_context):
    the deepest run's when there are depths."""
    from moedesk.bench.depth import measure_at_depth
    from moedesk.bench.routing import replayed, routing_calibration
    from moedesk.engine.load.synthetic import shape_config

    load = CpuLoad()  # from the build on: a profile measured beside other work misplaces experts too
    room = bench_context(prefill, decode_tokens, contexts, context_chunk)
    bench = prepare_file(model_file, gpu_budget_gib, device, room, log) if model_file else \
        prepare_synthetic(shape, layers, gpu_budget_gib, device, room, policy, log, expert_format, feed=feed,
                          calibration=routing_calibration(shape_config(shape, layers), routing))
    model, executor, cfg, device, dtype = bench.model, bench.executor, bench.cfg, bench.device, bench.dtype
    profile, expert_bytes = bench.profile, bench.orchestra.expert_bytes

    def decode(sequences: int) -> BenchResult:
        with replayed(model, cfg, sorted(bench.banks), routing, sequences, decode_tokens + 8):
            r = measure_decode(model, executor, cfg, device, dtype, sequences, decode_tokens, feed=feed)
        r.experts = executor.stats.as_dict()  # the timed steps' split: what a run below its bound spent its time on
        return r

    # Bounds: the offloaded experts each run really touched, read at the measured CPU bandwidth (decode)
    # or copied at the measured PCIe bandwidth (prefill, where the CPU may also take a share: >100% is possible).
    read_bps, h2d_bps = profile["cpu_read_gbs"] * 1e9, profile["h2d_gbs"] * 1e9
    results = []
    r = decode(1)
    r.bound_tok_s = traffic_bound(executor.stats, decode_tokens - 2, 1, expert_bytes, read_bps)
    results.append(r)
    for n in prefill:
        with replayed(model, cfg, sorted(bench.banks), routing, n, 4):  # a trace step a round: a prompt of n tokens
            # A warm round first, untimed, as llama-bench's: a size's first prefill grows the executor's buffers and
            # builds kernels, which left the rounds' spread and their summed stats about that round rather than the rest.
            measure_prefill(model, executor, cfg, device, dtype, n, seed=1, repeat=1)
            executor.stats = type(executor.stats)()
            r = measure_prefill(model, executor, cfg, device, dtype, n, repeat=3)
        # Per run: the counts cover every round (a bound over fewer steps than ran overstated the % of bound).
        r.bound_tok_s = traffic_bound(executor.stats, r.rounds, n, expert_bytes, h2d_bps)
        r.experts = executor.stats.as_dict()
        results.append(r)
    if batch > 1:
        r = decode(batch)
        r.bound_tok_s = traffic_bound(executor.stats, decode_tokens - 2, batch, expert_bytes, read_bps)
        results.append(r)
    for depth in contexts:
        log(f"context {depth}: prefilling it, then decode and a {context_chunk}-token prefill piece")
        t = measure_at_depth(model, executor, device, dtype, random_prompt(depth + context_chunk, cfg.vocab_size, depth),
                             depth, decode_tokens, context_chunk, feed=feed, seed=depth)
        results += [BenchResult("decode", decode_tokens, 1, t.decode_s, t.decode_steps / t.decode_s,
                                traffic_bound(executor.stats, t.decode_steps, 1, expert_bytes, read_bps), depth,
                                feed=feed, experts_touched=t.experts_touched),
                    BenchResult("prefill", t.chunk, 1, t.prefill_s, t.chunk / t.prefill_s, depth=depth)]
    executor.stats = type(executor.stats)()
    return {**bench.header(), "feed": feed, "routing": routing, "profile": dict(profile),
            "results": [x.as_dict() for x in results],
            "other_cpu_share": round(load.others(), 3)}


def format_results(report: dict) -> str:
    budget = report["gpu_budget_gib"]
    budget = ",".join(f"{b:g}" for b in budget) if isinstance(budget, (list, tuple)) else budget
    lines = [f"{report['shape']} x{report['layers']} layers, {report['experts']} experts, "
             f"budget {budget} GiB, "
             f"{report['experts_on_gpu']} experts on GPU, {report['policy']}",
             *report.get("format_notes", ())]
    for d in report.get("devices", ()):  # layers spread over several GPUs
        lines.append(f"GPU {d['device']} ({d['torch_device']}): MoE layers {d['moe_layers'][0]}-{d['moe_layers'][1]}, "
                     f"{d['experts_on_gpu']} of {d['experts_total']} experts")
    if report.get("budget_split_bytes"):
        lines.append(f"budget: {_split_text(report['budget_split_bytes'])}")
    if report.get("feed"):
        lines.append("decode steps feed " + ("random tokens, as llama-bench" if report["feed"] == "random" else
                                             "the model's own greedy choice"))
    if report.get("routing", "model") != "model":
        lines.append(f"decode and prefill routed by a replayed {report['routing']} trace (bench.routing); the "
                     "context depths by the model's routers")
    rows = []
    for r in report["results"]:
        pct = f"{r['pct_of_bound']:.0f}" if r["pct_of_bound"] is not None else "-"
        spread_ = f"±{50 * r['spread']:.0f}%" if r.get("spread") is not None else "-"
        rows.append([r["mode"], str(r["tokens"]), str(r["batch"]), str(r.get("depth", 0)), significant(r["tok_s"]),
                     spread_, significant(r["bound_tok_s"]), pct])
    lines += text_table(["mode", "tokens", "batch", "depth", "tok/s", "spread", "bound", "% bound"], rows)
    lines += [split_line(r) for r in report["results"] if r.get("experts")]
    lines += [line for line in map(stall_line, report["results"]) if line]
    warning = busy_warning(report.get("other_cpu_share") or 0.0)
    if warning:
        lines.append(warning)
    return "\n".join(lines)


def split_line(result: dict) -> str:
    """Where a run's offloaded experts ran, per prefill run or per decode step: the split the CPU and the copies
    shared, and the resident experts beside them."""
    e = result["experts"]
    if result["mode"] == "prefill":
        per, label = result.get("rounds") or 1, f"prefill {result['tokens']}, per run"
    else:  # measure_decode times every step after the first
        per, label = max(result["tokens"] - 2, 1), f"{result['mode'].replace('_', ' ')} of {result['batch']}, per step"
    return (f"{label}: {e['experts_cpu'] / per:.0f} experts on the CPU, {e['experts_copied'] / per:.0f} copied, "
            f"{e['experts_zero_copy'] / per:.0f} read zero-copy, {e['experts_gpu'] / per:.0f} resident; "
            f"{e['moe_ms'] / per:.1f} ms in the experts ({e['cpu_expert_ms'] / per:.1f} of it the CPU's call, "
            f"{e['gpu_wait_ms'] / per:.1f} waiting for the routing, {e.get('queue_ms', 0.0) / per:.1f} queueing)")


def _experts_per_step(stats, steps: int) -> float:
    return round((stats.gpu_experts + stats.cpu_experts + stats.copied_experts + stats.zero_copy_experts) / steps, 1)


def measure_beam(bench: BenchModel, beams: int = 8, new_tokens: int = 32, prompt: int = 32, rounds: int = 3,
                 log=print) -> dict:
    """Beam search of `beams` hypotheses against batched decode of `beams` sequences, step for step, on the same
    executor and placement (issue 16's target: a beam step at most 1.2 batched steps). The rounds alternate the two,
    so that a drift of the machine hits both alike; medians over the rounds.

    A beam step is one forward of the W hypotheses plus choosing their continuations and gathering their cache
    rows; it runs every step here (no end-of-sequence token ends a hypothesis). Batched decode is timed from its
    second step, as `measure_decode` does (the first captures its CUDA graphs); the beam search's graphs are
    captured by a warm-up search first."""
    import statistics

    from moedesk.engine.generation.beam import BeamSearch
    from moedesk.engine.generation.cuda_graphs import graphs_wanted

    if beams < 1 or new_tokens < 4 or rounds < 1:
        raise ValueError("need beams >= 1, new tokens >= 4 and rounds >= 1")
    model, executor, cfg, device, dtype = bench.model, bench.executor, bench.cfg, bench.device, bench.dtype
    search = BeamSearch(model, device, dtype, prompt + new_tokens + 1, graphs=graphs_wanted(device))
    search.reserve(beams, prompt + new_tokens)  # the warm-up then captures the graphs of the cache the runs use
    search.run(random_prompt(prompt, cfg.vocab_size, 99), executor, beams, 3)
    batched_ms, beam_ms, runs = [], [], []
    for r in range(rounds):
        # Greedy: beam search's rows follow the model's own choices too, so both sides decode their own trajectories.
        result = measure_decode(model, executor, cfg, device, dtype, beams, new_tokens, prompt, seed=10 * r,
                                feed="greedy")
        steps = new_tokens - 2
        batched_ms.append(1000 * result.seconds / steps)
        batched_active = _experts_per_step(executor.stats, steps) if hasattr(executor, "stats") else None
        if hasattr(executor, "stats"):
            executor.stats = type(executor.stats)()
        found = search.run(random_prompt(prompt, cfg.vocab_size, 10 * r + 5), executor, beams, new_tokens)
        beam_ms.append(1000 * found.decode_s / found.steps)
        beam_active = _experts_per_step(executor.stats, found.steps + 1) if hasattr(executor, "stats") else None
        runs.append({"round": r, "batched_step_ms": round(batched_ms[-1], 3), "beam_step_ms": round(beam_ms[-1], 3),
                     "ratio": round(beam_ms[-1] / batched_ms[-1], 4), "beam_steps": found.steps,
                     "beam_prefill_ms": round(1000 * found.prefill_s, 2),
                     "experts_per_step": {"batched": batched_active, "beam": beam_active}})
        log(f"round {r}: batched decode of {beams} {batched_ms[-1]:.1f} ms/step, beam search W={beams} "
            f"{beam_ms[-1]:.1f} ms/step ({runs[-1]['ratio']:.2f}x)")
    batched, beam = statistics.median(batched_ms), statistics.median(beam_ms)
    return {"beams": beams, "new_tokens": new_tokens, "prompt_tokens": prompt, "rounds": runs,
            "graphs": search.runner.graphs is not None and search.runner.graphs.broken is None,
            "batched_step_ms": round(batched, 3), "beam_step_ms": round(beam, 3), "ratio": round(beam / batched, 4)}


def format_beam(report: dict) -> str:
    b = report["beam"]
    return "\n".join([
        f"{report['shape']} x{report['layers']} layers, {report['experts']} experts, "
        f"budget {report['gpu_budget_gib']} GiB, {report['experts_on_gpu']} experts on GPU; "
        f"{b['new_tokens']} steps after a {b['prompt_tokens']}-token prompt, "
        f"median of {len(b['rounds'])} rounds",
        f"batched decode of {b['beams']} sequences  {b['batched_step_ms']:>9.2f} ms/step",
        f"beam search, W = {b['beams']}{'':>11}{b['beam_step_ms']:>9.2f} ms/step",
        f"beam / batched{'':>19}{b['ratio']:>9.2f}x"])
