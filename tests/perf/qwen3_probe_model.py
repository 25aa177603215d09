"""What the decode probes share (GPU box): the Qwen3-30B-A3B shape, first layers, every expert in pinned RAM and
computed on the CPU, one warm-up decode done. Import from a probe run as `python3 tests/perf/<probe>.py`."""
import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.engine.load.synthetic import shape_config, synthetic_model


def qwen3_all_in_ram(layers: int = 12, expert_format: str = "dense"):
    """(device, cfg, model, executor), the executor deciding every offloaded expert to the CPU; expert_format:
    16-bit experts or a packed format (kernels.quant_formats)."""
    device = torch.device("cuda")
    cfg = shape_config("qwen3-30b-a3b", layers)
    model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256,
                                   expert_format=expert_format)
    executor = OffloadExecutor(banks, [[False] * cfg.num_experts for _ in banks], device,
                               lambda loads: (sorted(loads), []))
    measure_decode(model, executor, cfg, device, torch.bfloat16, 1, 4)
    return device, cfg, model, executor
