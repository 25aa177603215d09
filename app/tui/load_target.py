"""What the next model load will use, as far as memory goes: the Models screen's and the download wizard's
estimates are for it."""
from __future__ import annotations

from typing import NamedTuple


class LoadTarget(NamedTuple):
    """What the next load will use, as far as memory goes."""

    expert_dtype: str  # auto | bf16 | int8 | int4
    weights_dtype: str  # float32 | bfloat16 | float16: the weights dtype setting with auto resolved
    gpu: bool  # a CUDA GPU: experts in RAM, the rest on it

    def describe(self) -> str:
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[self.weights_dtype]
        return f"expert dtype {self.expert_dtype}, {short} weights{' on the GPU' if self.gpu else ''}"


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
    dtype = options.get("dtype")
    if dtype is None:  # as engine.load.loader.resolve_dtype decides it
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if gpu else "float32"
    return LoadTarget(options.get("expert_dtype") or "auto", dtype, gpu)
