"""A hand-written start-up profile, for tests whose assertions rest on decisions the engine takes from it.

Engine.load profiles one expert at start-up (engine.offload.profiler, cached per machine) and every expert
decision is read off those timings: which offloaded experts the CPU computes and which are copied to the GPU
(assignment.assign_offloaded), whether resident experts move to the CPU (assignment.resident_on_cpu), how many
of a lone token's experts, or rows, the GPU reads from RAM itself (assignment.lone_token_split), whole layers or
popularity first (placement.plan_placement), and so whether a batch-1 decode step is handed to the host
(OffloadExecutor.host_only, which engine.generation.cuda_graphs asks). Beside another job on the same GPU and
CPU the timings change, the engine picks another layout, and a test asserting the layout fails although
nothing is wrong. `pin_profile` makes Engine.load read a fixed profile instead of measuring one (the seam is
the profile cache, engine.offload.orchestration's `cached_profile`), so the layout is the same on any machine
under any load.

`HOST_ONLY`: a CPU that computes any expert in a few ms and a PCIe link over which one costs 50 ms, so
- every offloaded expert runs on the CPU (queueing a copy alone costs the host more than the CPU's work on an
  expert of up to ~9,000 tokens, where the tests' steps have tens: assign_offloaded keeps them all on the CPU
  without a search);
- no resident expert moves to the CPU (resident_launch_ms 0: launching them costs the host nothing);
- the GPU streams no expert and no rows from RAM (no zero_copy_split_ms measured: lone_token_split says (0, 0));
  tests that want streaming set `executor.zero_copy_ranks` / `split_width` themselves;
- placement goes by popularity (no round trip and no launch cost: whole layers never save anything);
- hence every layer of a batch-1 step with experts in RAM is `host_only`, and on the GPU (Triton and the
  native handoff there, MOEDESK_NO_HANDOFF unset) the step is one handed-over graph.
That is what an idle GPU box measures for the tiny test models, whose experts are far cheaper on the CPU than
over PCIe.
"""
from __future__ import annotations

import copy

HOST_ONLY = {
    "cpu_expert_ms": {1: 0.02, 16: 0.03, 256: 0.2, 4096: 2.0},
    "gpu_expert_ms": {1: 0.01, 4096: 0.5},
    "copy_expert_ms": 50.0,
    "copy_launch_ms": 5.0,
    "resident_launch_ms": 0.0,
    "activation_roundtrip_ms": 0.0,
    "cpu_slowdown_during_copy": 1.0,
    "copy_slowdown_during_cpu": 1.0,
}


# The opposite machine: a CPU that takes 50 ms over any expert and a copy that costs nothing, so every offloaded
# expert a step uses is copied to the GPU and computed there (still no streaming, resident ones on the GPU).
COPIES = {**HOST_ONLY, "cpu_expert_ms": {1: 50.0, 16: 60.0, 256: 100.0, 4096: 1000.0},
          "copy_expert_ms": 0.01, "copy_launch_ms": 0.001}


def pin_profile(monkeypatch, profile: dict = HOST_ONLY) -> dict:
    """Every Engine.load in the test reads `profile` (a copy each) instead of measuring or reading the cache;
    nothing is written to the cache. Returns the profile."""
    from moedesk.engine.offload import orchestration

    def cached_profile(cache_dir, key, measure, reprofile=False):
        return copy.deepcopy(profile)

    monkeypatch.setattr(orchestration, "cached_profile", cached_profile)
    return profile
