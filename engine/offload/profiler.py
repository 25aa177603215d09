"""Start-up measurements that the expert decisions rest on, cached per machine, model shape and dtype.

What is measured: one expert's latency on the CPU for 1..256 tokens (and calls of four experts at
1..16 tokens each, which part an expert's share of a call from the call's own cost) and on the GPU for
1..4096 tokens, the pinned host-to-GPU copy of one expert, an activation round trip, the CPU's
read bandwidth, how much CPU expert reads and copies slow each other down when they run
together, and a decode layer's experts split between the CPU and the GPU reading some of them
straight from RAM (`profile_zero_copy`). Without a GPU the "GPU" tier is the CPU (the simulated
tier CI runs).
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import torch

from moedesk.engine.graph_capture import capturing
from moedesk.engine.json_cache import cached_json
from moedesk.kernels import cpu_experts, cpu_quant, gpu_zero_copy
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.experts import expert_forward, experts_forward_routed
from moedesk.kernels.quant_formats import FORMATS

CPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A step's CPU experts go to the kernel in one call. Calls of this many experts, at the token counts of decode and
# batched decode, tell a call's own cost from each expert's share (engine.offload.latency_model).
CALL_EXPERTS = 4
CALL_TOKENS = (1, 2, 4, 8, 16)
GPU_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def _timed_ms(fn, device: torch.device, repeat: int) -> float:
    """Median wall time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def device_link(src, dst, hidden: int, dtype: torch.dtype, megabytes: int = 64, repeat: int = 10) -> dict:
    """What a cut between two devices costs (engine.model.layer_devices): one token's hidden state copied across
    (ms, mostly the link's latency) and the link's bandwidth on a `megabytes` block (GB/s: PCIe or NVLink)."""
    src, dst = torch.device(src), torch.device(dst)

    def timed(tensor) -> float:
        times = []
        for i in range(repeat + 1):
            for d in {src, dst}:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
            start = time.perf_counter()
            tensor.to(dst, copy=True)
            for d in {src, dst}:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
            if i:  # the first is a warm-up (peer access set up)
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    token = torch.zeros(1, hidden, dtype=dtype, device=src)
    block = torch.zeros(megabytes * 2**20, dtype=torch.uint8, device=src)
    return {"token_ms": timed(token) * 1e3, "gbs": block.numel() / timed(block) / 1e9}


def cpu_read_gbs(megabytes: int = 1024) -> float:
    """The CPU's read bandwidth over a buffer far larger than the caches: the faster of a parallel
    torch sum (as docs/measurements.md, "Facts measured on the GPU box", measured it) and, where it runs,
    the native experts kernel streaming one expert of that size for one token, which is how decode reads
    experts (and often the faster)."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    ms = _timed_ms(lambda: buf.sum(), torch.device("cpu"), 5)
    best = buf.numel() * 4 / ms / 1e6
    del buf
    if cpu_experts.available():
        call, nbytes = _one_token_expert_call(megabytes)
        best = max(best, nbytes / _timed_ms(call, torch.device("cpu"), 5) / 1e6)
    return best


def _one_token_expert_call(megabytes: int):
    """(call, bytes): one CPU experts call for one token over a bf16 expert of about `megabytes`,
    which streams its weights once from memory, as decode does."""
    hidden = 4096
    width = megabytes * 2**20 // (3 * hidden * 2)  # gate, up and down in bf16
    gate_up = torch.zeros((1, 2 * width, hidden), dtype=torch.bfloat16)
    down = torch.zeros((1, hidden, width), dtype=torch.bfloat16)
    x, one, rows, offsets = torch.zeros(1, hidden, dtype=torch.bfloat16), *map(torch.tensor, ([0], [0], [0, 1]))

    def call():
        cpu_experts.experts_forward(x, rows, one, offsets, gate_up, down)

    return call, (gate_up.numel() + down.numel()) * 2


def profile_expert(w: ExpertWeights, device, dtype: torch.dtype | None = None, cpu_tokens=CPU_TOKENS,
                   gpu_tokens=GPU_TOKENS, repeat: int = 5) -> dict:
    """Raw measurements for one expert of the stack `w` (a layer's experts in host memory, or one of them) computing
    activations of `dtype` (default: the stack's own float dtype, bf16 for packed experts).

    The CPU's calls take the stack's experts in turn, so that each reads its weights from RAM as a real step does,
    not from the last-level cache: a packed expert can fit a server CPU's last-level cache, and timed again and again
    it comes out far faster than a real step computes it (docs/measurements.md, "The start-up profile")."""
    device = torch.device(device)
    hidden = w.hidden
    dtype = dtype or w.dense_dtype or torch.bfloat16
    one = w.expert(0)
    expert_bytes = one.expert_bytes
    cpu, call = {}, {}
    group = min(CALL_EXPERTS, w.num_experts)
    # The CPU tier computes experts through experts_forward_routed: time that path, n pairs on one expert, and
    # (where the stack has several) n pairs on each of `group` experts in one call, right after at the same n.
    for n in cpu_tokens:
        x, out = torch.randn(n, hidden, dtype=dtype), torch.empty(n, hidden, dtype=dtype)
        cpu[n] = _timed_ms(_taking_turns(w, x, out), torch.device("cpu"), repeat)
        if group > 1 and n in CALL_TOKENS:
            x, out = torch.randn(n * group, hidden, dtype=dtype), torch.empty(n * group, hidden, dtype=dtype)
            call[n] = _timed_ms(_taking_turns(w, x, out, group), torch.device("cpu"), repeat)
    calls = {"cpu_call_ms": call, "cpu_call_experts": group} if call else {}
    on_device = one.to(device)
    gpu = {}
    for n in gpu_tokens:
        x = torch.randn(n, hidden, dtype=dtype, device=device)
        gpu[n] = _timed_ms(lambda: expert_forward(x, on_device), device, repeat)
    staging = on_device.empty_like()
    copy_ms = _timed_ms(lambda: staging.copy_(one, non_blocking=True), device, repeat)
    extra = {**contention(w, device, dtype), "copy_launch_ms": copy_launch_ms(staging, dtype, device),
             "resident_launch_ms": resident_launch_ms(one, dtype, device)} if device.type == "cuda" else {}
    act = torch.randn(1, hidden, dtype=dtype, device=device)
    roundtrip_ms = _timed_ms(lambda: act.cpu().to(device), device, repeat)
    return {
        "cpu_expert_ms": cpu, **calls, "gpu_expert_ms": gpu, "copy_expert_ms": copy_ms,
        "activation_roundtrip_ms": roundtrip_ms, "expert_bytes": expert_bytes,
        "h2d_gbs": expert_bytes / copy_ms / 1e6, "cpu_read_gbs": cpu_read_gbs(),
        "threads": torch.get_num_threads(), "cpu_experts": cpu_experts.describe(), "device": str(device),
        "pinned": w.is_pinned(), **extra,
    }


def _taking_turns(w: ExpertWeights, x: torch.Tensor, out: torch.Tensor, group: int = 1):
    """A call computing x's rows, `len(x) // group` tokens each, on the next `group` experts of the stack w (one
    CPU kernel call, as a layer step makes it): the experts are taken in turn from one call to the next."""
    per_expert = len(x) // group
    routes = [torch.arange(first, first + group).remainder(w.num_experts).repeat_interleave(per_expert)
              for first in range(0, w.num_experts, group)]
    turn = [0]

    def call():
        pairs = routes[turn[0] % len(routes)]
        turn[0] += 1
        experts_forward_routed(x, pairs, 1, None, w, out)

    return call


def copy_launch_ms(staging: ExpertWeights, dtype, device, repeat: int = 20) -> float:
    """Host time the executor spends queueing one copied expert: its copy on a side stream and its
    GPU compute, through the executor's own two calls (median; the GPU is drained between tries
    so that nothing blocks)."""
    from moedesk.engine.offload.offload_executor import compute_copied, queue_copy

    x = torch.randn(4, staging.hidden, dtype=dtype, device=device)
    rows = torch.tensor([1, 2], device=device)
    host = staging.empty_like("cpu").pin_memory()
    side = torch.cuda.Stream(device)
    return _host_ms(lambda: compute_copied(x[rows], staging, queue_copy(side, host, staging)), device, repeat)


def profile_zero_copy(w: ExpertWeights, top_k: int, device, most: int = 4, repeat: int = 15,
                      dtype: torch.dtype | None = None) -> dict:
    """A decode layer's experts for one token split between the CPU and the GPU, which reads its share from
    pinned RAM (kernels.gpu_zero_copy), timed as decode runs them: {"zero_copy_split_ms": {g: ms}} for g = 0..
    min(top_k, most) experts read zero-copy, each the median time until both sides are done, and "zero_copy_top_k".
    {} where zero-copy reads do not apply.

    Measured rather than predicted from one expert's costs: SMs and the CPU reading RAM together slow each
    other by amounts that varied between runs on one machine, and a layer's fixed host costs sit on the CPU's
    side. w is a layer's pinned stacks, dense or packed (then dtype is the activations'); each try takes experts
    the last tries did not, so that they come from RAM, not from a cache. The GPU's share is replayed from a CUDA
    graph, as in decode. "split_width_ms": {rows: ms} the same with every expert's last `rows` intermediate rows
    on the GPU and the first ones on the CPU (`split_width_candidates`).

    The options take turns, try by try: timed one after another, the CPU alone came out faster in one start-up than
    in others, and that run read nothing zero-copy and decoded slower (docs/measurements.md, "The start-up profile")."""
    device = torch.device(device)
    if not gpu_zero_copy.applies(device, w):
        return {}
    experts, hidden = w.num_experts, w.hidden
    dtype = w.dense_dtype or dtype or torch.bfloat16  # packed experts take the model's activations
    x_host = torch.randn(1, hidden, dtype=dtype).pin_memory()
    x = x_host.to(device)
    cpu_out = torch.empty(top_k, hidden, dtype=dtype, pin_memory=True)
    gpu_out = torch.empty(top_k, hidden, dtype=dtype, device=device)
    gpu_partial = torch.empty(top_k, hidden, dtype=torch.float32, device=device)
    index = torch.empty(2 * top_k + 2 * experts + 1, dtype=torch.int64)
    turn = [0]

    def next_experts(n: int) -> list[int]:
        first, turn[0] = turn[0], (turn[0] + n) % experts
        return [(first + i) % experts for i in range(n)]

    def gpu_share(ids: torch.Tensor, **kw) -> torch.cuda.CUDAGraph:
        gpu_zero_copy.zero_copy_experts(x, ids, 0, w, **kw)  # compiles before the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            gpu_zero_copy.zero_copy_experts(x, ids, 0, w, **kw)
        return graph

    # (key, zero-copy experts, the CPU's width of each expert, graph of the GPU's share, its expert ids)
    options = []
    for zero_copy in range(min(top_k, most) + 1):
        ids = torch.zeros(1, max(zero_copy, 1), dtype=torch.int64, device=device)
        options.append((("split", zero_copy), zero_copy, None, gpu_share(ids, out=gpu_out) if zero_copy else None, ids))
    for gpu_width in split_width_candidates(w):
        ids = torch.zeros(1, top_k, dtype=torch.int64, device=device)
        cpu_width = w.width - gpu_width
        options.append((("width", gpu_width), 0, cpu_width, gpu_share(ids, out=gpu_partial, first_row=cpu_width), ids))
    times = {key: [] for key, *_ in options}
    for i in range(repeat + 1):
        for j in range(len(options)):
            key, zero_copy, cpu_width, graph, ids = options[(i + j) % len(options)]  # a rotating order
            if cpu_width is None:  # whole experts: the GPU the last `zero_copy`, the CPU the others
                if zero_copy:
                    ids.copy_(torch.tensor([next_experts(zero_copy)]))
                pairs = torch.tensor(sorted(next_experts(top_k - zero_copy)), dtype=torch.int64)
            else:  # every expert: the CPU the first of its width, the GPU the rest
                pairs = torch.tensor(sorted(next_experts(top_k)), dtype=torch.int64)
                ids.copy_(pairs.view(1, -1))
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            if graph is not None:
                graph.replay()
            if len(pairs):
                experts_forward_routed(x_host, pairs, len(pairs), None, w, cpu_out, index, rows=cpu_width)
            torch.cuda.synchronize(device)
            if i:  # the first round warms up
                times[key].append((time.perf_counter() - start) * 1e3)
    median = {key: statistics.median(v) for key, v in times.items()}
    return {"zero_copy_split_ms": {g: ms for (kind, g), ms in median.items() if kind == "split"},
            "zero_copy_top_k": top_k,
            "split_width_ms": {width: ms for (kind, width), ms in median.items() if kind == "width"}}


def split_width_candidates(w: ExpertWeights, most: float = 0.5, steps: int = 16) -> list[int]:
    """The GPU's shares of every expert's intermediate rows that profile_zero_copy times: about 1/16, 2/16, ... of
    the width up to `most` of it, the CPU's first rows a whole number of granules (kernels.gpu_zero_copy.row_granule)."""
    granule, width = gpu_zero_copy.row_granule(w), w.width
    shares = {width - -(-(width * (steps - i) // steps) // granule) * granule for i in range(1, steps + 1)}
    return sorted(r for r in shares if 0 < r < width and r <= most * width)


def resident_launch_ms(w: ExpertWeights, dtype, device, repeat: int = 20) -> float:
    """Host time the executor spends queueing a decode step's GPU-resident experts (two, one token each)
    through its own path: index copy, gather, grouped launches, scatter (median; the GPU drained between
    tries so that nothing blocks). A layer pays it once whenever any resident expert has tokens."""
    from types import SimpleNamespace

    from moedesk.engine.offload.expert_executor import HostRouting
    from moedesk.engine.offload.offload_executor import OffloadExecutor

    stack = ExpertWeights(w.gate_up.expand(2, -1, -1), w.down.expand(2, -1, -1), w.hidden, w.width,
                          w.gate_up_format, w.down_format)  # the same expert twice, not copied
    executor = OffloadExecutor({0: stack}, [[True, True]], device, decide=lambda loads: ([], []), staging_slots=1)
    moe = SimpleNamespace(layer=0)
    x = torch.randn(1, w.hidden, dtype=dtype, device=device)
    ids = torch.tensor([[0, 1]])
    host = HostRouting(x.cpu(), ids, None)
    out = torch.empty(2, x.shape[1], dtype=x.dtype, device=device)
    ids_on_device = ids.to(device)
    return _host_ms(lambda: executor.expert_outputs(moe, x, ids_on_device, out=out, host=host), device, repeat)


def _host_ms(call, device, repeat: int) -> float:
    """Median host time of call() in ms, the GPU drained before each try so that nothing blocks; the
    first try (warm-up) is left out."""
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize(device)
    times = sorted(times[1:])
    return times[len(times) // 2]


# A prefill step's CPU call: this many experts at each of these loads (a 512-token prompt gives gpt-oss's 128
# experts ~16 tokens each). From 8 tokens (the AMX path's least) the latency model reads an expert's share here.
PREFILL_EXPERTS = 8
PREFILL_TOKENS = (8, 16, 32, 64)


def profile_prefill_cpu(w: ExpertWeights, dtype: torch.dtype | None = None, tokens=PREFILL_TOKENS,
                        experts: int = PREFILL_EXPERTS, repeat: int = 3) -> dict:
    """Calls of `experts` experts of the stack w at prefill loads, on every path of the CPU kernel this machine may
    take: {"cpu_prefill_ms": {path: {tokens: ms}}, "cpu_prefill_experts": experts, "cpu_path": the path chosen}.

    Packed experts: the kernel's path in use ("vnni" normally), and "amx" beside it where the CPU has AMX-INT8, the
    user forced no path, and a call on the tiles gives what the path in use gives (`amx_agrees`); the faster is
    chosen (engine.offload.cpu_paths.choose_cpu_path). Unpacked experts: their one path, "dense". The calls take the
    stack's experts in turn, from RAM, as a step does; the kernel's path is left as it was found."""
    from moedesk.engine.offload.cpu_paths import choose_cpu_path, forced_path

    dtype = dtype or w.dense_dtype or torch.bfloat16
    group = min(experts, w.num_experts)
    inputs = {n: (torch.randn(n * group, w.hidden, dtype=dtype), torch.empty(n * group, w.hidden, dtype=dtype))
              for n in tokens}
    packed = cpu_quant.applies(inputs[tokens[0]][0], w)
    before = cpu_quant.get_path() if packed else "dense"
    paths = [before]
    if packed and before == "vnni" and forced_path() is None and cpu_quant.amx_supported() and amx_agrees(w, dtype):
        paths.append("amx")
    calls = {}
    try:
        for path in paths:
            if packed:
                cpu_quant.set_path(path)
            calls[path] = {n: _timed_ms(_taking_turns(w, x, out, group), torch.device("cpu"), repeat)
                           for n, (x, out) in inputs.items()}
    finally:
        if packed:
            cpu_quant.set_path(before)
    return {"cpu_prefill_ms": calls, "cpu_prefill_experts": group, "cpu_path": choose_cpu_path(calls, before)}


def amx_agrees(w: ExpertWeights, dtype: torch.dtype, tokens: int = 16, rel: float = 1e-3) -> bool:
    """Whether the packed kernel's AMX path computes two experts of w at `tokens` tokens each as the path in use
    does (the same arithmetic, summed in another order: within `rel` of the output's largest value), and runs at
    all: a safeguard before a path first run on a new CPU is timed, let alone chosen."""
    before = cpu_quant.get_path()
    x = torch.randn(2 * tokens, w.hidden, dtype=torch.float32)
    pairs = torch.tensor([0] * tokens + [min(1, w.num_experts - 1)] * tokens)
    outs = []
    try:
        for path in (before, "amx"):
            cpu_quant.set_path(path)
            out = torch.zeros(2 * tokens, w.hidden, dtype=torch.float32)
            experts_forward_routed(x, pairs, 1, None, w, out)
            outs.append(out)
    except (RuntimeError, ValueError):
        return False
    finally:
        cpu_quant.set_path(before)
    reference, amx = outs
    scale = float(reference.abs().max())
    return bool(torch.isfinite(amx).all()) and float((amx - reference).abs().max()) <= rel * max(scale, 1e-30)


def copy_launch_prefill_ms(w: ExpertWeights, dtype, device, tokens=(16, 64), copies: int = 8, repeat: int = 5) -> dict:
    """Host time per copied expert when a prefill step queues `copies` of them back to back (the executor's own
    two calls each, the GPU drained only between tries), at each of `tokens` tokens an expert:
    {"copy_launch_prefill_ms": {tokens: ms}}. The lone drained copy of `copy_launch_ms` underprices these."""
    from moedesk.engine.offload.offload_executor import compute_copied, queue_copy

    dtype = dtype or w.dense_dtype or torch.bfloat16
    staging = [w.expert(0).empty_like(device) for _ in range(copies)]
    side = torch.cuda.Stream(device)
    turn = [0]
    result = {}
    for n in tokens:
        x = torch.randn(n, w.hidden, dtype=dtype, device=device)

        def queue_all():
            first, turn[0] = turn[0], turn[0] + copies
            for i, slot in enumerate(staging):
                compute_copied(x, slot, queue_copy(side, w.expert((first + i) % w.num_experts), slot))

        result[n] = _host_ms(queue_all, device, repeat) / copies
    return {"copy_launch_prefill_ms": result}


def copy_queue_prefill_ms(w: ExpertWeights, device, copies: int = 16, repeat: int = 5) -> dict:
    """Host time per copy when a prefill step's copy run queues `copies` experts' copies back to back, no two of them
    neighbours (so each its own copy), with one event for them all, as OffloadExecutor._copy_run does:
    {"copy_queue_prefill_ms": ms}. Their compute is one grouped launch a run, which `copy_launch_prefill_ms` prices."""
    copies = max(1, min(copies, (w.num_experts + 1) // 2))
    staging = w.expert(0).empty_like(device, experts=copies)
    side = torch.cuda.Stream(device)
    turn = [0]

    def queue_all():
        first, turn[0] = turn[0], turn[0] + 2 * copies
        with torch.cuda.stream(side):
            for i in range(copies):
                e = (first + 2 * i) % w.num_experts
                staging.copy_experts_(i, w, e, 1, non_blocking=True)
            side.record_event()

    return {"copy_queue_prefill_ms": _host_ms(queue_all, device, repeat) / copies}


CONTENTION_TOKENS = (1, 4, 16)


def contention(w: ExpertWeights, device, dtype: torch.dtype | None = None, tokens=CONTENTION_TOKENS,
               megabytes: int = 64, calls: int = 6) -> dict:
    """How much a layer's CPU experts and host-to-GPU expert copies slow each other down when they run at the same
    time, with `n` tokens an expert for each n in `tokens`: {"cpu_slowdown_during_copy": {n: factor},
    "copy_slowdown_during_cpu": {n: factor}}; {} where the stack is not pinned (its copies would not overlap).

    Both stream host memory, but how much the CPU's side suffers depends on how much of its time is reads, so this is
    measured with the model's own experts and kernel at a few token counts: the CPU suffers most at one token, and
    hardly at sixteen, where its instructions hold it more than RAM (docs/measurements.md, "The start-up profile").
    The CPU calls and the copies each take `megabytes` or more of experts at a time, the next ones each time (from
    RAM, not a cache); first each alone, then the copies queued on a side stream while the CPU calls run one after
    another until the copies are done.
    """
    if not w.is_pinned():
        return {}
    dtype = dtype or w.dense_dtype or torch.bfloat16
    group = min(max(1, w.num_experts // 2), math.ceil(megabytes * 2**20 / w.expert_bytes))
    staging = [w.expert(0).empty_like(device) for _ in range(group)]
    turn = [0]

    def copy():
        first, turn[0] = turn[0], turn[0] + group
        for i, slot in enumerate(staging):
            slot.copy_(w.expert((first + i) % w.num_experts), non_blocking=True)

    copy_ms = _timed_ms(copy, device, calls)
    cpu_slowdown, copy_slowdown = {}, {}
    for n in tokens:
        x, out = torch.randn(n * group, w.hidden, dtype=dtype), torch.empty(n * group, w.hidden, dtype=dtype)
        cpu_call = _taking_turns(w, x, out, group)
        cpu_ms = _timed_ms(cpu_call, torch.device("cpu"), 2 * calls)
        copies = max(2, math.ceil(calls * cpu_ms / copy_ms))
        cpu_during, copy_during = [], []
        for _ in range(3):  # the median of three: single tries varied widely, and so did the splits they led to
            for _ in range(3):  # too few CPU calls fitted beside the copies (the CPU slowed more than guessed): longer
                times, copies_ms = _overlapped(cpu_call, copy, copies, device)
                if len(times) >= 2:
                    break
                copies *= 4
            else:
                return {}
            cpu_during.append(sorted(times)[len(times) // 2])
            copy_during.append(copies_ms / copies)
        # Alone again, right after: the faster of the two is the time alone (a first series can run
        # slow while the CPU clocks up, which would make contention look like a speed-up).
        cpu_ms = min(cpu_ms, _timed_ms(cpu_call, torch.device("cpu"), 2 * calls))
        cpu_slowdown[n] = statistics.median(cpu_during) / cpu_ms
        copy_slowdown[n] = statistics.median(copy_during) / copy_ms
    return {"cpu_slowdown_during_copy": cpu_slowdown, "copy_slowdown_during_cpu": copy_slowdown}


def _overlapped(cpu_call, copy, n: int, device) -> tuple[list[float], float]:
    """Queue n copies on a side stream, time CPU calls one after another until they are done: (the CPU
    calls' times in ms, leaving out the last, which may have outlived the copies; the copies' total ms)."""
    side = torch.cuda.Stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        start.record()
        for _ in range(n):
            copy()
        end.record()
    times = []
    while not end.query():
        t = time.perf_counter()
        cpu_call()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize(device)
    return times[:-1], start.elapsed_time(end)


# Part of every profile's cache key: raise it when the profiler measures something new, so that profiles
# cached before are measured again rather than read without it (2: resident_launch_ms; 3: CPU experts timed
# through the routed call the executor now makes; 4: streamed_expert_ms, no longer measured; 5: zero_copy_split_ms;
# 6: zero_copy_split_ms of packed experts too; 7: split_width_ms; 8: the streaming options timed taking turns;
# 9: the CPU's experts timed taking turns, and the contention factors per token count, with the model's experts;
# 10: cpu_call_ms, calls of several experts; 11: the zero-copy keys, named streamed_* before; 12: split_width_ms,
# named split_rows_ms before; 13: cpu_prefill_ms per kernel path with cpu_path, copy_launch_prefill_ms;
# 14: copy_queue_prefill_ms).
PROFILE_FORMAT = 14


def profile_key(fingerprint: str, shape: tuple, dtype, device) -> str:
    """dtype: the experts' storage (ExpertWeights.describe(): "bfloat16", "q4_k/q6_k", ...). The kernels that will
    compute the experts on the CPU are part of the key, path and build: a profile timed with other kernels (an
    update, MOEDESK_QUANT_PATH) is measured again rather than trusted."""
    kernels = [cpu_experts.describe(), cpu_experts.build_id()]
    if any(part in FORMATS for part in str(dtype).split("/")):  # packed experts: their kernel, built only for them
        kernels += [cpu_quant.describe(), cpu_quant.build_id()]
    raw = json.dumps([fingerprint, list(shape), str(dtype), str(device), torch.get_num_threads(), *kernels,
                      PROFILE_FORMAT])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cached_profile(cache_dir: Path, key: str, measure, reprofile: bool = False) -> dict:
    """The profile stored under key, or measure() now and store it."""
    return _with_int_keys(cached_json(Path(cache_dir) / f"profile-{key}.json", measure, reprofile))


def _with_int_keys(points: dict) -> dict:
    # JSON turns the token-count keys into strings.
    for key in ("cpu_expert_ms", "cpu_call_ms", "gpu_expert_ms", "zero_copy_split_ms", "split_width_ms", "cpu_slowdown_during_copy",
                "copy_slowdown_during_cpu", "copy_launch_prefill_ms"):
        if isinstance(points.get(key), dict):
            points[key] = {int(n): ms for n, ms in points[key].items()}
    if isinstance(points.get("cpu_prefill_ms"), dict):
        points["cpu_prefill_ms"] = {path: {int(n): ms for n, ms in calls.items()}
                                    for path, calls in points["cpu_prefill_ms"].items() if isinstance(calls, dict)}
    return points
