"""Probe (GPU box): what does a decode step's GPU work consist of, and where does the GPU wait?

Usage: python3 tests/perf/probe_segment.py [FORMAT] (default dense; e.g. q4_k). Qwen3 shape, 12 layers, every
expert on the CPU (so the GPU runs only attention, norms, router, the ordered sum and the handoff), batch 1.
Prints the step's tok/s unprofiled; then, from a profiled run's trace ($OUT/segment_trace.json): kernels and
copies per step by name with their mean GPU time; per step the GPU's busy time apart from the handoff's waits,
the waits, and the idle gaps between consecutive GPU events (launch latency inside the graph); and one middle
layer's events in order, each with the gap before it."""
import collections
import json
import os
import statistics
import sys
import time

import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload import offload_executor
from qwen3_probe_model import qwen3_all_in_ram

FORMAT = sys.argv[1] if len(sys.argv) > 1 else "dense"
STEPS = 8
OUT = os.environ.get("OUT", "/tmp")
WAIT = "_await_flag"
device, cfg, model, ex = qwen3_all_in_ram(expert_format=FORMAT)
kernel_s = []  # the host's calls of the experts' kernel: through its wrapper, or prepared (OffloadExecutor.host_plan)
unwrapped = offload_executor.experts_forward_routed
unprepared = getattr(offload_executor, "prepare_routed", None)  # older trees: none


def timed(call):
    def run(*args, **kwargs):
        started = time.perf_counter()
        call(*args, **kwargs)
        kernel_s.append(time.perf_counter() - started)
    return run


def timed_prepare(*args, **kwargs):
    prepared = unprepared(*args, **kwargs)
    return prepared and timed(prepared)


offload_executor.experts_forward_routed, offload_executor.prepare_routed = timed(unwrapped), timed_prepare
speeds, host = [], []
for _ in range(3):
    kernel_s.clear()
    speeds.append(measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 40).tok_s)
    s = ex.stats  # the timed steps' (they restart with them; kernel_s has the capture's calls too)
    calls = s.selections // cfg.num_experts_per_tok  # one token a step: a call per layer
    host.append((s.wait_ms / calls, s.cpu_ms / calls, 1e3 * statistics.median(kernel_s[-calls:])))
offload_executor.experts_forward_routed, offload_executor.prepare_routed = unwrapped, unprepared
print(f"{FORMAT}: {statistics.median(speeds):.1f} tok/s unprofiled ({1000 / statistics.median(speeds):.2f} ms a step)")
print("host, per layer (ms): waiting for the GPU's routing %.3f, experts after it %.3f, of which the kernel's call %.3f"
      % tuple(statistics.median(h[i] for h in host) for i in range(3)))

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, STEPS + 2)
trace = os.path.join(OUT, "segment_trace.json")
p.export_chrome_trace(trace)
with open(trace) as f:
    events = [e for e in json.load(f)["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
events.sort(key=lambda e: e["ts"])
short = lambda e: e["name"][:70]
count, total = collections.Counter(), collections.Counter()
for e in events:
    count[short(e)] += 1
    total[short(e)] += e["dur"]
steps = STEPS + 1  # the profiled run's decode steps (its first, the capture, included: a small error)
print(f"GPU events per step {len(events) / steps:.0f}")
for name, c in count.most_common():
    print(f"{c / steps:7.1f}/step {total[name] / c:8.1f} us  {name}")

# The timeline: split at each step's first event (the handoff graph's _load_step kernel).
starts = [i for i, e in enumerate(events) if e["name"].startswith("_load_step")]
rows = []
for a, b in zip(starts, starts[1:]):
    step = events[a:b]
    waits = sum(e["dur"] for e in step if e["name"].startswith(WAIT))
    busy = sum(e["dur"] for e in step) - waits
    gaps = sum(max(0.0, n["ts"] - (e["ts"] + e["dur"])) for e, n in zip(step, step[1:]))
    span = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
    rows.append((span, busy, waits, gaps, len(step)))
if rows:
    print("\nper step (µs): span, GPU busy without waits, handoff waits, gaps between events, events")
    for r in rows:
        print("  " + "  ".join(f"{v:8.1f}" for v in r))
    mid = starts[len(starts) // 2]
    step = events[mid:starts[starts.index(mid) + 1]] if starts.index(mid) + 1 < len(starts) else events[mid:]
    waits = [i for i, e in enumerate(step) if e["name"].startswith(WAIT)]
    if len(waits) > 6:
        layer = step[waits[5] + 1:waits[6] + 1]
        print("\none middle layer, from after one handoff wait to the next wait's end: gap before, duration (µs)")
        prev_end = step[waits[5]]["ts"] + step[waits[5]]["dur"]
        for e in layer:
            print(f"  {e['ts'] - prev_end:7.1f} {e['dur']:7.1f}  {short(e)}")
            prev_end = e["ts"] + e["dur"]
    print("\nmedian step (µs): span %.0f, busy %.0f, waits %.0f, gaps %.0f" %
          tuple(statistics.median(r[i] for r in rows) for i in range(4)))
