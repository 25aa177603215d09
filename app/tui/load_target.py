"""What the next model load will use, as far as memory goes: the Models screen's and the download wizard's
estimates are for it."""
from __future__ import annotations

from typing import NamedTuple


class LoadTarget(NamedTuple):
    """What the next load will use, as far as memory goes."""

    expert_dtype: str  # auto | bf16 | int8 | int4
    weights_dtype: str  # float32 | bfloat16 | float16: the weights dtype setting with auto resolved
    gpu: bool  # a CUDA GPU: experts in RAM, the rest on it
    budgets: tuple[float, ...] = ()  # GiB per GPU, where --gpu-budget names several (the layers spread over them)
    gpu_budget: float | None = None  # GiB, where --gpu-budget names one figure
    context: int | None = None  # --context (None: the engine's default)
    device: str = "auto"  # what the next load is asked for: "cpu" keeps llama.cpp off the GPU too
    engine: str = "auto"  # the engine setting (--engine): which rows the llama.cpp engine's plan sizes

    def describe(self) -> str:
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[self.weights_dtype]
        spread = f", GPU budgets {' + '.join(f'{b:g}' for b in self.budgets)} GiB" if self.budgets else \
            f", GPU budget {self.gpu_budget:g} GiB" if self.gpu_budget is not None else ""
        # What else sizes a llama.cpp plan, where set
        context = f", context {self.context}" if self.context else ""
        engine = f", engine {self.engine}" if self.engine != "auto" else ""
        return f"expert dtype {self.expert_dtype}, {short} weights{' on the GPU' if self.gpu else ''}{spread}" \
               f"{context}{engine}"


def load_target(app) -> LoadTarget:
    """The settings with this run's flags over them (MoedeskApp.load_options), on the device the loaded model
    is on (later loads keep it), else the one `auto` picks."""
    options = app.load_options() if hasattr(app, "load_options") else app.settings.load_options()
    engine = getattr(app, "engine", None)
    import torch

    if engine is not None and hasattr(engine, "device"):
        gpu = engine.device.type == "cuda"
    else:
        gpu = torch.cuda.is_available()
    device = getattr(app, "load_device", None) or "auto"  # the device every load of this run is asked for
    budget = options.get("gpu_budget")
    budgets = tuple(budget) if isinstance(budget, (tuple, list)) and len(budget) > 1 else ()
    one = budget[0] if isinstance(budget, (tuple, list)) and len(budget) == 1 else None if budgets else budget
    dtype = options.get("dtype") or (default_weights_dtype(device, len(budgets)) if gpu else "float32")
    return LoadTarget(options.get("expert_dtype") or "auto", dtype, gpu, budgets, one,
                      getattr(app, "context_length", None), device, options.get("engine") or "auto")


def default_weights_dtype(device: str, spread: int = 0) -> str:
    """The weights dtype a native load on the GPU picks when none is named, asked of the engine's door
    (engine.runtime.default_weights_dtype: the named GPU, or every GPU of a spread over `spread`), so that the
    screen and the load agree."""
    from moedesk.engine import runtime

    return str(runtime.default_weights_dtype(device, spread)).removeprefix("torch.")
