"""A loaded model's layers run on several devices: each block where a plan put it, the hidden state moved at each cut.

Where each layer lives is engine.offload.devices' decision (consecutive layers per GPU); this carries it out on a
Transformer. Each block's weights go to its device, the embeddings stay on the first device (where the caller's
tokens are), the final norm and output head go to the last layer's device. A forward runs each run of layers under
its own device and copies the hidden state, with what the next layers read beside it (rotary tables, positions,
mask), once at each cut; the logits and any features come back to the first device, so the caller sees one device.

Devices are listed by plan index and may repeat: two "cpu" entries stand for two GPUs in the tests, where every
move is a no-op yet still counted (`crossings`). The model keeps no device bookkeeping beyond calling `forward` here.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from moedesk.engine.hardware import on_device


class LayerDevices:
    """The devices (plan index -> torch device) and the device index of every layer, as runs of consecutive layers."""

    def __init__(self, devices: Sequence, device_of_layer: Sequence[int]):
        self.devices = tuple(torch.device(d) for d in devices)
        self.device_of_layer = tuple(int(d) for d in device_of_layer)
        if not self.device_of_layer or any(not 0 <= d < len(self.devices) for d in self.device_of_layer):
            raise ValueError(f"device_of_layer {self.device_of_layer} does not index {len(self.devices)} devices")
        runs: list[tuple[int, int, int]] = []  # (device index, first layer, last layer + 1)
        for layer, d in enumerate(self.device_of_layer):
            if runs and runs[-1][0] == d:
                runs[-1] = (d, runs[-1][1], layer + 1)
            else:
                runs.append((d, layer, layer + 1))
        self.runs = tuple(runs)
        self.crossings = 0  # hidden-state copies between devices so far (a forward makes one per cut)

    @property
    def head_device(self) -> torch.device:
        return self.devices[self.runs[-1][0]]

    def cuts(self) -> int:
        """Copies of the hidden state one forward makes: one per change of device, from the embeddings on."""
        held = [0, *(d for d, _, _ in self.runs)]
        return sum(a != b for a, b in zip(held, held[1:]))

    def forward(self, model, x, rope, cache, batch, features: tuple, hidden: dict, logits_at):
        """Transformer.forward past the embeddings: each run of layers on its device, then the head on the last;
        logits (and features) on the first device. `cache` is the model's (new_cache), one part per run."""
        home, here = x.device, 0
        for d, start, stop in self.runs:
            if d != here:
                x, rope, batch = self._cross(x, rope, batch, self.devices[d])
                here = d
            with on_device(self.devices[d]):
                x = model.run_layers(x, rope, cache[start], batch, start, stop, features, hidden)
        with on_device(self.head_device):
            if logits_at is not None:
                logits_at = logits_at.to(self.head_device)
            logits = model.head(x, features, hidden, logits_at)
        for name in list(hidden):
            hidden[name] = hidden[name].to(home)
        return logits.to(home)

    def _cross(self, x, rope, batch, device):
        self.crossings += 1
        return x.to(device), tuple(t.to(device) for t in rope), batch.to(device)


def spread_model(model, devices: Sequence, device_of_layer: Sequence[int]) -> LayerDevices:
    """Move `model`'s blocks to their devices (a block's experts too where they live beside its weights, not in host
    banks) and its final norm and head to the last layer's; the model then runs through the returned LayerDevices.
    A model the loader already put there (engine.load.loader.load_model's layer_devices) has nothing moved."""
    spread = LayerDevices(devices, device_of_layer)
    home = model.embed.device
    for block, d in zip(model.layers, spread.device_of_layer):
        device = spread.devices[d]
        if not all(_same(t.device, device) for t in (*block.parameters(), *block.buffers())):
            block.to(device)  # packed weights (engine.model.packed_linear) are buffers: they move too
            if hasattr(block.attn, "qkv_weight") or "qkv_packed" in block.attn.__dict__:
                # Moving copies q, k and v apart from their fused weight: fuse again so each is held once.
                block.attn.fuse_projections()
        moe = getattr(block, "moe", None)
        if moe is not None and moe.experts.gate_up.device == home:
            moe.experts = moe.experts.to(device)
    last = spread.head_device
    model.norm.to(last)
    # (a packed head, engine.model.packed_linear, is never the table: its `weight` would be a dequantised copy)
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.embed.weight and last != home:
        # A tied head reads the embedding table: the last device gets a copy of its own (as the plan counts it).
        # The loader makes it from the checkpoint there (engine.load.loader); this copy is for a model loaded whole.
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().to(last), requires_grad=False)
    else:
        model.lm_head.to(last)
    model.spread = spread
    if home.type == "cuda":
        torch.cuda.empty_cache()  # the moved blocks' old copies, back to the first device
    return spread


def _same(held: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on `held` is on `wanted` ("cuda" means the current GPU: index 0 unless set)."""
    return held.type == wanted.type and (held.index or 0) == (wanted.index or 0)
