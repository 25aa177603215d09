"""`moedesk profile`: what this machine has, how fast one expert runs where, and the placement that follows."""
from __future__ import annotations

import torch


def add_profile_arguments(parser) -> None:
    parser.add_argument("--gpu-budget", type=float, default=None, metavar="GiB",
                        help="GPU memory for experts (default: free GPU memory less 10%%; 0 without a GPU)")
    parser.add_argument("--reprofile", action="store_true", help="measure again instead of using the cached profile")


def run_profile(args, engine_loader, out=print) -> int:
    from engine.calibration import cached_popularity
    from engine.demo import cache_root
    from engine.hardware import detect_hardware, format_hardware, machine_fingerprint
    from engine.latency_model import fit_latency_model
    from engine.placement import plan_placement
    from engine.profiler import cached_profile, profile_expert, profile_key

    info = detect_hardware()
    out(format_hardware(info))
    engine = engine_loader(args)
    cfg = engine.config
    out(f"\nmodel: {engine.description}")
    if not cfg.is_moe:
        out("dense model: no experts to place")
        return 0
    moe = engine.model.moe_blocks()[0]
    expert = moe.experts[0]
    gate_up = torch.cat([expert.gate.weight, expert.up.weight]).cpu()
    down = expert.down.weight.cpu().contiguous()
    if torch.cuda.is_available():
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts)
    fingerprint = machine_fingerprint(info)
    key = profile_key(fingerprint, shape, gate_up.dtype, device)
    points = cached_profile(cache_root(), key, lambda: profile_expert(gate_up, down, device), args.reprofile)
    model = fit_latency_model(points)
    tier = "GPU" if device.type == "cuda" else "GPU tier simulated on the CPU"
    out(f"\none expert ({points['expert_bytes'] / 2**20:.1f} MiB), {tier}; CPU read {points['cpu_read_gbs']:.0f} GB/s, "
        f"copy {points['copy_expert_ms']:.2f} ms")
    out(f"{'tokens':>8}{'CPU ms':>10}{'GPU ms':>10}")
    for n in (1, 4, 16, 64, 256):
        out(f"{n:>8}{model.cpu_expert_ms(n):>10.3f}{model.gpu_expert_ms(n):>10.3f}")

    popularity = cached_popularity(cache_root(), f"{key}-{engine.name.replace('/', '_')[-40:]}", engine, args.reprofile)
    budget_gib = args.gpu_budget
    if budget_gib is None:
        budget_gib = info.gpus[0].free_bytes * 0.9 / 2**30 if info.gpus else 0.0
    placement = plan_placement(points["expert_bytes"], len(popularity), cfg.num_experts, popularity,
                               int(budget_gib * 2**30), 0)
    total = len(popularity) * cfg.num_experts
    out(f"\nplacement at {budget_gib:.1f} GiB: {placement.experts_on_gpu} of {total} experts on the GPU, "
        f"expected GPU hit rate {placement.gpu_hit_rate(popularity):.0%}")
    for layer, row in enumerate(placement.as_lists()):
        out(f"  layer {layer:>3}: " + "".join("G" if flag else "." for flag in row))
    return 0
