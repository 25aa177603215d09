"""Probe (GPU box; python3 tests/perf/probe_step_timeline.py): where a decode step's host time goes, Qwen3 shape,
12 layers, every expert on the CPU, batch 1, the engine's own thread count (argument: an expert format, e.g. q4_k;
default 16-bit). Host timestamps around the decoder's
parts: preparing the step's inputs, each layer's experts (the executor: its wait for the routing and its CPU work),
the graph launches between them, and the logits' argmax with the wait for the last graph. Inside the executor's
CPU work, the kernel's own call (kernels.experts.experts_forward_routed) apart from the bookkeeping around it."""
import collections
import statistics
import sys
import time

import torch

import moedesk.engine.generation.cuda_graphs as cg
import moedesk.engine.generation.decoder as gen
import moedesk.engine.generation.runner as runner
import moedesk.engine.offload.offload_executor as oe
from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload.orchestration import leave_a_core_to_the_gpu_thread
from qwen3_probe_model import qwen3_all_in_ram

marks = []  # (label, perf_counter)


def mark(label):
    marks.append((label, time.perf_counter()))


def around(cls, name, before, after):
    original = getattr(cls, name)

    def wrapped(*a, **k):
        mark(before)
        result = original(*a, **k)
        mark(after)
        return result
    setattr(cls, name, wrapped)


around(runner.ModelRunner, "step", "step>", "step<")  # the whole decode step's forward (graphs or eager)
around(cg._Captured, "_experts", "experts>", "experts<")
around(cg._Captured, "_load", "load>", "load<")
around(oe, "experts_forward_routed", "kernel>", "kernel<")
_accept = gen.Decoder._accept


def accept(self, seqs, logits):
    mark("accept>")
    greedy = torch.argmax(logits, dim=-1).tolist()  # the same sync the decoder does first
    mark("argmax<")
    yield from _accept(self, seqs, logits)
    mark("accept<")


gen.Decoder._accept = accept
threads = leave_a_core_to_the_gpu_thread()
device, cfg, model, ex = qwen3_all_in_ram(expert_format=sys.argv[1] if len(sys.argv) > 1 else "dense")
marks.clear()
r = measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 40)
s = ex.stats
# Intervals between consecutive marks, named by the pair, summed per step over the steady steps.
starts = [i for i, (label, _) in enumerate(marks) if label == "step>"]
per = collections.defaultdict(list)
for a, b in zip(starts[5:-1], starts[6:]):
    spans = collections.Counter()
    for (l1, t1), (l2, t2) in zip(marks[a:b], marks[a + 1:b + 1]):
        key = f"{l1}..{l2}"
        if key == "experts<..experts>":
            key = "graph launch between layers"
        spans[key] += (t2 - t1) * 1e3
    for k, v in spans.items():
        per[k].append(v)
steps = len(starts) - 6
print(f"threads {threads}; decode {r.tok_s:.1f} tok/s = {1e3 / r.tok_s:.3f} ms/step; executor per step: "
      f"layer {s.layer_ms / 38:.3f} wait {s.wait_ms / 38:.3f} cpu {s.cpu_ms / 38:.3f} ms")
print(f"{'interval (ms per step, median over ' + str(steps) + ' steps)':<60}{'median':>8}")
for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
    print(f"{k:<60}{statistics.median(v):>8.3f}")
