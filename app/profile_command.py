"""`moedesk profile`: what this machine has, how fast one expert runs where, and the placement that follows."""
from __future__ import annotations


def zero_copy_line(costs, top_k: int, chosen: tuple[int, int], layers: int | None = None) -> str | None:
    """The measured decode splits (engine.offload.profiler.profile_zero_copy) and the one `chosen` (the orchestra's
    lone_token_split: whole experts, width); None if not measured. layers: how many MoE layers the split runs in
    (the executor splits only layers with no expert resident), where the placement is known."""
    if not costs.zero_copy_split_ms:
        return None
    splits = " · ".join(f"{g}: {ms:.3f}" for g, ms in enumerate(costs.zero_copy_split_ms))
    line = f"one token's {top_k} experts, n of them read by the GPU from RAM (n: ms) {splits}"
    if costs.split_width_ms:
        line += ("; or the last w of each one's width (w: ms) "
                 + " · ".join(f"{w}: {ms:.3f}" for w, ms in costs.split_width_ms))
    ranks, width = chosen
    decision = f"decode reads {ranks} zero-copy" if ranks else \
        f"decode splits the width, the GPU the last {width}" if width else "decode reads none zero-copy"
    if (ranks or width) and layers is not None:
        decision += f" in the {layers} layers with no expert on the GPU" if layers else \
            ", where a layer has no expert on the GPU: none here"
    return f"{line}; {decision}"


def placement_line(summary: dict) -> str:
    """The orchestra's summary in a line: the experts on the GPU, the hit rate expected, and the room the plan left
    free where it did (engine/offload/placement.py's `experts_room`)."""
    hit, placed = summary["expected_gpu_hit_rate"], summary["experts_on_gpu"]
    free = summary.get("experts_room", 0) - placed
    return (f"placement at {summary['gpu_budget_gib']:.2f} GiB: {placed} of {summary['experts_total']} experts on the "
            "GPU" + (f", expected GPU hit rate {hit:.0%}" if hit is not None
                     else " (no popularity: the model has no tokenizer)")
            + (f"; room for {free} more left free: a layer with no expert on the GPU shares a lone token with it, "
               "which the profile timed faster" if free > 0 else ""))


def budget_line(split, table_in_ram: int = 0) -> str:
    """Where a named GPU budget went before the experts (engine.offload.gpu_budget.BudgetSplit), and the token table's
    bytes where they stay in RAM instead (engine.model.embedding)."""
    line = (f"GPU budget {_mib(split.budget)}: weights {_mib(split.weights)}, KV cache of {split.context} positions "
            f"{_mib(split.kv_cache)}, workspace {_mib(split.workspace)}, slack {_mib(split.slack)}, "
            f"experts {_mib(split.experts)}")
    return line + (f"; the token table ({_mib(table_in_ram)}) in RAM, a row read a token" if table_in_ram else "")


def contention_line(costs) -> str | None:
    """How much CPU experts and copies slowed each other at each measured token count; None if neither did."""
    if not any(cpu > 1 or copy > 1 for _, cpu, copy in costs.contention):
        return None
    return ("CPU experts and copies at once, slower by (tokens an expert: CPU, copies) "
            + " · ".join(f"{n:.0f}: x{cpu:.2f}, x{copy:.2f}" for n, cpu, copy in costs.contention))


def prefill_line(costs, profile: dict) -> str | None:
    """What a prefill step's experts are priced at (engine.offload.latency_model's cpu_share and copy_launch_at): an
    expert's share of a CPU call at each load measured, on the kernel path chosen, and each copy's launch queued
    back to back; None if neither was measured."""
    parts = []
    if costs.cpu_share:
        parts.append(f"an expert's share of a CPU call on {profile.get('cpu_path', '?')} (tokens: ms) "
                     + " · ".join(f"{n:.0f}: {ms:.3f}" for n, ms in costs.cpu_share))
    if costs.copy_launch_by_tokens:
        parts.append("a copy's launch queued back to back " + " · ".join(
            f"{n:.0f}: {ms:.3f}" for n, ms in costs.copy_launch_by_tokens))
    return "prefill loads: " + "; ".join(parts) if parts else None


def run_profile(args, engine_loader, out=print) -> int:
    from moedesk.engine.hardware import detect_hardware, format_hardware

    info = detect_hardware()
    out(format_hardware(info))
    # Offload on even without a GPU: the CPU then stands in for the GPU tier, and the profile
    # and placement are what a machine with this budget would use.
    engine = engine_loader(args, offload=True)
    cfg = engine.config
    out(f"\nmodel: {engine.description}")
    out(f"engine: {engine.why}")
    if not cfg.is_moe:
        out("dense model: no experts to place")
        return 0
    if engine.orchestra is None:  # llama.cpp: a layer's experts are one tensor, placed whole
        return _layer_placement(engine, out)
    orchestra = engine.orchestra
    costs = orchestra.costs
    tier = "GPU" if engine.device.type == "cuda" else "GPU tier simulated on the CPU"
    out(f"\none expert ({orchestra.expert_bytes / 2**20:.1f} MiB), {tier}; "
        f"CPU read {orchestra.profile['cpu_read_gbs']:.0f} GB/s, "
        f"copy {costs.copy_expert_ms:.2f} ms")
    out(f"CPU experts: {orchestra.cpu_path()}")
    contention = contention_line(costs)
    if contention:
        out(contention)
    # "CPU ms": a call of this one expert; "in a call": what one more expert adds to a call of several.
    out(f"{'tokens':>8}{'CPU ms':>10}{'in a call':>11}{'GPU ms':>10}")
    for n in (1, 4, 16, 64, 256):
        out(f"{n:>8}{costs.cpu_alone_ms(n):>10.3f}{costs.cpu_expert_ms(n):>11.3f}{costs.gpu_expert_ms(n):>10.3f}")
    prefill = prefill_line(costs, orchestra.profile)
    if prefill:
        out(prefill)
    on_gpu = engine.expert_map()[0]
    clear = sum(not any(row) for row in on_gpu) if orchestra.executor.splits_lone_tokens else None
    zero_copy = zero_copy_line(costs, cfg.num_experts_per_tok, orchestra.lone_token_split(), clear)
    if zero_copy:
        out(zero_copy)
    summary = orchestra.summary()
    out("\n" + placement_line(summary))
    split = getattr(engine, "budget_split", None)  # where a named budget went before the experts
    if split is not None:
        out(budget_line(split, getattr(engine, "table_in_ram_bytes", 0)))
    if summary["popularity_evenness"] is not None:
        out(f"popularity: {summary['popularity_evenness']:.0%} even routing mixed into the calibration counts "
            f"(how little one half of the calibration prompts predicted the other)")
    whole = sum(all(row) for row in on_gpu)
    if whole:
        out(f"{whole} whole layers on the GPU" + (" (run inside the decode graphs)"
                                                  if orchestra.executor.whole_layers_on_device else ""))
    for line in map_lines(on_gpu):
        out(line)
    plan = engine.device_plan_lines()  # --gpu-budget named several GPUs
    if plan:
        out("")
        for line in plan:
            out(line)
    for warning in engine.warnings:
        out(f"warning: {warning}")
    return 0


def _layer_placement(engine, out) -> int:
    """Where an engine that places whole layers' experts (llama.cpp) put them, its map (map_lines)."""
    stats = engine.expert_stats()
    if isinstance(stats.get("placement"), str):  # a remote server's: it does not report where experts are
        out(f"\nplacement: {stats['placement']}")
        return 0
    out(f"\nplacement per layer (a GGUF holds a layer's experts as one tensor): {stats.get('experts_on_gpu', 0)} of "
        f"{stats.get('experts_total', 0)} experts on the GPU, {stats.get('expert_gib_in_ram', 0):.2f} GiB of experts "
        f"in RAM")
    for line in map_lines(engine.expert_map()[0]):
        out(line)
    for warning in engine.warnings:
        out(f"warning: {warning}")
    return 0


def map_lines(on_gpu) -> list[str]:
    """A line per run of layers placed alike ("G": an expert on the GPU, ".": in RAM): a whole model's map is a few
    lines, not one per layer, where whole layers or none of a layer sit on the GPU."""
    rows = ["".join("G" if flag else "." for flag in row) for row in on_gpu]
    lines, first = [], 0
    for layer, row in enumerate(rows):
        if layer + 1 < len(rows) and rows[layer + 1] == row:
            continue
        span = f"layer  {first:>3}" if first == layer else f"layers {first:>3}-{layer}"
        lines.append(f"  {span + ':':<15} {row}")  # the maps aligned whatever the spans
        first = layer + 1
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
