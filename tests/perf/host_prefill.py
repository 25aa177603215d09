"""The offload executor's host time in a whole-model prefill, without the model: Mixtral's routing shape driven
through `OffloadExecutor.expert_outputs` layer after layer, with experts narrow enough that their arithmetic is
cheap and the bookkeeping shows (issue 42; docs/measurements.md, "Session 37: where Mixtral's prefill 512 at 16 GiB
goes").

The routing is the one session 37's run was rebuilt to (8 experts, top-2, 512 tokens, 32 layers): 16 layers whose
offloaded experts have loads {56, 6, 4}, 9 with {60, 6}, 5 with {6, 4, 2}, 2 with every expert resident; the heavy
one of each layer is copied, the light ones go to the CPU (56 CPU experts, 25 copies a prefill, as in the run). The
executor runs as the engine builds it for a balanced prefill: the CPU's call beside the queueing of the copies,
copied experts in one copy run, a remembered split.

Printed per prefill (the round of least thread time of --rounds): the executor's time (`moe_ms`), the CPU experts'
call, the wait for the routing and what is left, the host's bookkeeping; the CPU time of the executor's thread (the
CPU's call on its worker left out; on a shared machine the steadier figure); with --profile, the top ops by self CPU time (torch.profiler) and
the top Python functions (cProfile); with --calls, the torch calls the executor's thread makes, by caller line (each
a dispatch on any device and a launch on a GPU).

Usage, repo root:
  python tests/perf/host_prefill.py [--rounds 5] [--width 16] [--hidden 4096] [--profile]     (the simulated tier)
  python3 tests/perf/host_prefill.py --device cuda --format q4_k --width 256 --calls --profile  (the GPU box)
q4_k is for the GPU box: the simulated tier dequantises packed experts in torch, seconds a prefill.
On the simulated tier the "GPU's" share (resident experts, copies) is computed on the CPU as it is queued, so its
arithmetic counts in the executor's time; keep --width small. On CUDA that share is queued, and what is left beside
the CPU's call is host time.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from moedesk.engine.offload import offload_executor
from moedesk.engine.offload.assignment import RememberedSplit, copy_run_limit, resident_grouped
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.kernels.expert_weights import ExpertWeights

EXPERTS, TOP_K, TOKENS = 8, 2, 512
RESIDENT = 4  # experts 0-3 resident in every layer that is not whole on the GPU; 4-7 offloaded
# Offloaded experts' loads per layer kind, and how many layers of each (session 37's rebuilt routing).
LAYER_KINDS = [((56, 6, 4), 16), ((60, 6), 9), ((6, 4, 2), 5), ((), 2)]
COPY_MIN_LOAD = 20  # an offloaded expert with this many tokens or more is copied, as the run's split did
MIXTRAL_HF = (4096, 14336)  # the shape the executor's size-dependent decisions are taken for, whatever --width


class Layer:  # what expert_outputs reads of an MoE block
    def __init__(self, layer: int):
        self.layer = layer


def split(loads: dict[int, int]) -> tuple[list[int], list[int]]:
    """The run's split: the heavy offloaded expert copied, the light ones on the CPU."""
    return sorted(e for e, n in loads.items() if n < COPY_MIN_LOAD), [e for e, n in loads.items() if n >= COPY_MIN_LOAD]


def layer_ids(offloaded_loads: tuple, whole: bool, g: torch.Generator) -> torch.Tensor:
    """[TOKENS, TOP_K] expert ids, distinct per token, with exactly these offloaded loads (experts 4, 5, ...) and the
    rest of the pairs spread over the resident experts."""
    loads = [0] * EXPERTS
    for i, n in enumerate(offloaded_loads):
        loads[RESIDENT + i] = n
    spread = list(range(EXPERTS if whole else RESIDENT))
    left = TOKENS * TOP_K - sum(loads)
    for i, e in enumerate(spread):
        loads[e] += left // len(spread) + (i < left % len(spread))
    pairs = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(loads))  # sorted: no expert over TOKENS
    ids = torch.stack([pairs[:TOKENS], pairs[TOKENS:]], dim=1)  # token t: pairs t and t + TOKENS, distinct
    ids = ids[torch.randperm(TOKENS, generator=g)]
    flip = torch.rand(TOKENS, generator=g) < 0.5
    return torch.where(flip[:, None], ids.flip(1), ids)


def build(hidden: int, width: int, device: str, dtype: torch.dtype, fmt: str = "bf16", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kinds = [(loads, whole) for (loads, count) in LAYER_KINDS for whole in [not loads] * count]
    banks, on_gpu, routing = {}, [], []
    if fmt == "bf16":
        stack = ExpertWeights((torch.randn(EXPERTS, 2 * width, hidden, generator=g) / hidden ** 0.5).to(dtype),
                              (torch.randn(EXPERTS, hidden, width, generator=g) / width ** 0.5).to(dtype), hidden,
                              width)
    else:  # packed, as the Q4_K_M run's experts: hidden and width multiples of the format's block
        from tests.kernels.test_gpu_quant_kernel import random_experts
        stack = random_experts(EXPERTS, hidden, width, fmt, seed=seed)
    if device != "cpu":
        stack = stack.pin_memory()
    for layer, (loads, whole) in enumerate(kinds):
        banks[layer] = stack  # one stack for every layer: the host time does not depend on which weights
        on_gpu.append([whole or e < RESIDENT for e in range(EXPERTS)])
        routing.append(layer_ids(loads, whole, g).to(device))
    # Narrow experts would be "small" (one grouped launch for the resident share); Mixtral's take one call each.
    offload_executor.resident_grouped = lambda sizes, hidden, width, *rest: resident_grouped(sizes, *MIXTRAL_HF, *rest)
    offload_executor.copy_run_limit = lambda hidden, width: copy_run_limit(*MIXTRAL_HF)  # 3 experts a span or run
    executor = OffloadExecutor(banks, on_gpu, device, RememberedSplit(split), resident_to_cpu=lambda loads: [],
                               overlap_copies=True, copy_runs=lambda loads, copy: [len(copy)])
    x = (torch.randn(TOKENS, hidden, generator=g) / 4).to(dtype).to(device)
    return executor, x, routing


def prefill(executor, x, routing, sync) -> list:
    outs = [executor.expert_outputs(Layer(layer), x, ids) for layer, ids in enumerate(routing)]
    sync()
    return outs


def count_calls(executor, x, routing, sync, top: int) -> None:
    """The torch calls the executor's thread makes (the CPU's call on its worker thread left out), by the line of
    moedesk that makes them: each costs the host its dispatch on any device, and a launch on a GPU."""
    import collections
    import sys

    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.depth = collections.Counter(), 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if self.depth == 0:  # only calls made from outside torch
                frame = sys._getframe(1)
                while frame is not None and "/torch/" in frame.f_code.co_filename:
                    frame = frame.f_back
                where = "?" if frame is None else f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}"
                self.calls[(getattr(func, "__name__", str(func)), where)] += 1
            self.depth += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.depth -= 1

    counter = Count()
    with counter:
        prefill(executor, x, routing, sync)
    total = sum(counter.calls.values())
    print(f"  torch calls by the executor's thread: {total} a prefill, {total / len(routing):.1f} a layer")
    for (name, where), n in counter.calls.most_common(top):
        print(f"    {n:5d}  {name:<16s} {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=4096, help="Mixtral's; the activations' bytes follow it")
    parser.add_argument("--width", type=int, default=16, help="each expert's intermediate size (Mixtral: 14336)")
    parser.add_argument("--format", default="bf16", help="the experts' format: bf16, or packed (q4_k as the run's, "
                        "with --width 256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's and cProfile's top entries")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--calls", action="store_true",
                        help="count the torch calls the executor's thread makes per layer, by caller line")
    args = parser.parse_args()
    torch.manual_seed(0)
    executor, x, routing = build(args.hidden, args.width, args.device, torch.bfloat16, args.format)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        prefill(executor, x, routing, sync)  # warm: buffers, the remembered split, the kernels' first calls
        best = None
        for _ in range(args.rounds):
            before = executor.stats.copy()
            started, thread_started = time.perf_counter(), time.thread_time()
            prefill(executor, x, routing, sync)
            wall, thread = (time.perf_counter() - started) * 1e3, (time.thread_time() - thread_started) * 1e3
            s = executor.stats.since(before)
            if best is None or thread < best[1]:
                best = (wall, thread, s)
        wall, thread, s = best
        print(f"{args.device}, {args.format} experts, hidden {args.hidden}, width {args.width}, {len(routing)} layers of {TOKENS} tokens, "
              f"best of {args.rounds}")
        print(f"  wall {wall:.1f} ms, moe_ms {s.layer_ms:.1f}: CPU experts' call {s.cpu_ms:.1f}, wait {s.wait_ms:.1f}, "
              f"the rest (host) {s.layer_ms - s.cpu_ms - s.wait_ms:.1f} ms")
        print(f"  the executor's thread on a core: {thread:.1f} ms (unlike wall time, not stretched by other work on "
              f"the machine's cores)")
        print(f"  experts: {s.cpu_experts} CPU, {s.copied_experts} copied, {s.gpu_experts} resident")
        if args.calls:
            count_calls(executor, x, routing, sync, args.top)
        if not args.profile:
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            prefill(executor, x, routing, sync)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        profiler = cProfile.Profile()
        profiler.enable()
        prefill(executor, x, routing, sync)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue())


if __name__ == "__main__":
    main()
