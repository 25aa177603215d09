"""Experts of a model whose layers run on several devices: one orchestra per device, one executor in front of them.

Each device with MoE layers gets an engine.offload.orchestration.ExpertOrchestra of its own over its layers' host
banks: a latency model profiled on that device (its copies over its own link, its own kernels), an executor with
staging slots and a copy stream there, and the CPU/GPU split of every layer step priced by those costs. The model
sees one `DeviceExecutors`, which hands each MoE layer to its device's executor. Popularity is calibrated over the
whole model and shared out by layer; placement follows the per-device plan (engine.offload.devices), each device
placing its own hot experts under what its budget leaves after its layers' weights and KV cache.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from moedesk.engine.hardware import on_device
from moedesk.engine.offload.devices import DevicePlan
from moedesk.engine.offload.offload_executor import StepStats
from moedesk.engine.offload.orchestration import GIB, ExpertOrchestra
from moedesk.engine.offload.popularity import estimated_popularity


class DeviceExecutors:
    """The model's executor over several devices: each MoE layer's experts run by its device's executor. Counts
    (`selections`, `stats`) read as one model's; placements are one row per MoE layer in layer order, as for one."""

    def __init__(self, executors: Sequence, layers: Sequence[Sequence[int]]):
        """executors[i] runs the MoE layers layers[i] (ascending; the devices in the order of their layers)."""
        self.executors = list(executors)
        self.layers = [list(mine) for mine in layers]
        self.of = {layer: executor for executor, mine in zip(self.executors, self.layers) for layer in mine}

    def expert_outputs(self, moe, x, ids, out=None, host=None):
        return self.of[moe.layer].expert_outputs(moe, x, ids, out, host)

    def runs_on_device(self, layer: int) -> bool:
        return self.of[layer].runs_on_device(layer)

    def device_expert_outputs(self, moe, x, ids):
        return self.of[moe.layer].device_expert_outputs(moe, x, ids)

    @property
    def device(self):
        return self.executors[0].device

    @property
    def whole_layers_on_device(self) -> bool:
        return all(executor.whole_layers_on_device for executor in self.executors)

    @property
    def splits_lone_tokens(self) -> bool:
        return all(executor.splits_lone_tokens for executor in self.executors)

    @property
    def banks(self) -> dict:
        return {layer: bank for executor in self.executors for layer, bank in executor.banks.items()}

    @property
    def placement_version(self) -> int:
        return sum(executor.placement_version for executor in self.executors)

    @property
    def selections(self) -> dict:
        """layer -> counts, one dict the executors share (DeviceOrchestra.start): clearing it clears them all."""
        for executor in self.executors[1:]:
            executor.selections  # noqa: B018 -- folds what that device counted on the device into the shared dict
        return self.executors[0].selections

    @property
    def stats(self) -> StepStats:
        total = StepStats()
        for executor in self.executors:
            total = total + executor.stats
        return total

    @stats.setter
    def stats(self, value: StepStats) -> None:
        """The first device's counts become `value`, the others' start again: the sum reads `value`."""
        for executor in self.executors:
            executor.stats = value if executor is self.executors[0] else StepStats()

    def on_gpu(self) -> list[list[bool]]:
        return [row for executor in self.executors for row in executor.on_gpu()]

    def set_placement(self, on_gpu) -> None:
        rows = list(on_gpu)
        for executor, mine in zip(self.executors, self.layers):
            executor.set_placement(rows[:len(mine)])
            rows = rows[len(mine):]

    def follow_routing(self, policy, scores=None, price=None) -> None:
        for executor in self.executors:
            executor.follow_routing(policy, price=price)


class DeviceOrchestra:
    """What the engine and `moedesk profile` ask of an ExpertOrchestra, over one orchestra per device."""

    def __init__(self, parts: Sequence[ExpertOrchestra], devices: Sequence, device_of_part: Sequence[int],
                 layers: Sequence[Sequence[int]]):
        """parts[i]: the orchestra of plan device device_of_part[i] (of `devices`), over the MoE layers layers[i]."""
        self.parts, self.devices = list(parts), list(devices)
        self.device_of_part, self.layers = list(device_of_part), [list(mine) for mine in layers]
        self.executor = DeviceExecutors([part.executor for part in self.parts], self.layers)
        first = self.parts[0]
        self.costs, self.profile, self.profile_key = first.costs, first.profile, first.profile_key
        self.expert_bytes, self.top_k, self.cache = first.expert_bytes, first.top_k, first.cache
        self.warnings = first.warnings
        self.evenness: float | None = None
        self.plan: DevicePlan | None = None

    @classmethod
    def start(cls, banks: dict, devices: Sequence, device_of_layer: Sequence[int], profile_key_parts: tuple,
              cache_dir, reprofile: bool = False, warnings: list[str] | None = None, policy: str = "balanced",
              top_k: int = 1, dtype=None) -> "DeviceOrchestra":
        """An ExpertOrchestra.start for each device holding MoE layers, over those layers' banks (profiled on that
        device, the profile cached per device), their routing counted into one shared dict."""
        warnings = [] if warnings is None else warnings
        selections: dict = {}
        parts, owners, layers = [], [], []
        for d, device in enumerate(devices):
            mine = {layer: bank for layer, bank in sorted(banks.items()) if device_of_layer[layer] == d}
            if not mine:
                continue
            with on_device(device):  # the profile's kernels run on that GPU
                parts.append(ExpertOrchestra.start(mine, device, profile_key_parts, cache_dir, reprofile, warnings,
                                                   policy, top_k, dtype, selections=selections))
            parts[-1].executor.hands_over = False  # decode graphs over several devices hand nothing over
            owners.append(d)
            layers.append(sorted(mine))
        return cls(parts, devices, owners, layers)

    @property
    def popularity(self) -> list[list[float]]:
        return [row for part in self.parts for row in part.popularity]

    @property
    def placement(self):
        """None before anything was placed; then a device's placement, one keeping experts resident where any does:
        an out-of-memory retry (Engine._can_free) asks whether experts can move, and GPU 0 may hold none while GPU 1
        does. summary() counts every device."""
        placed = [part.placement for part in self.parts]
        if placed[0] is None:
            return None
        return next((p for p in placed if p is not None and p.experts_on_gpu), placed[0])

    def calibrate(self, halves) -> None:
        """estimated_popularity over the whole model's calibration (one evenness for all), shared out by layer."""
        counts, self.evenness = estimated_popularity(halves)
        rows = counts.tolist()
        for part, mine in zip(self.parts, self.layers):
            part.popularity, rows = rows[:len(mine)], rows[len(mine):]
            part.evenness = self.evenness

    def place_plan(self, plan: DevicePlan) -> None:
        """Each device's hot experts as `plan` chose them: its orchestra places them under the bytes its budget
        leaves after its layers' weights and KV cache (the same rule and its own costs, so the same experts, unless
        its GPU runs out of memory, where its budget shrinks as on one GPU)."""
        self.plan = plan
        for part, d in zip(self.parts, self.device_of_part):
            placed = plan.placements[d]
            with on_device(self.devices[d]):
                part.place(placed.budget_bytes - placed.non_expert_bytes - placed.reserve_bytes)

    def back_off(self) -> bool:
        """After a GPU out-of-memory error (on whichever device): every device halves its resident experts."""
        moved = []
        for part, d in zip(self.parts, self.device_of_part):
            with on_device(self.devices[d]):
                moved.append(part.back_off())
        return any(moved)

    def cpu_path(self) -> str:
        return self.parts[0].cpu_path()

    def lone_token_split(self) -> tuple[int, int]:
        return self.parts[0].lone_token_split()

    def device_lines(self) -> list[dict]:
        """Per device holding MoE layers: which device, its MoE layers and its resident experts; once placed, its
        budget and what it holds of it (its layers' weights and KV cache, and the experts resident now)."""
        lines = []
        for part, d, mine in zip(self.parts, self.device_of_part, self.layers):
            resident = part.placement.experts_on_gpu if part.placement else 0
            line = {"device": d, "torch_device": str(self.devices[d]), "moe_layers": [mine[0], mine[-1]],
                    "experts_on_gpu": resident, "experts_total": len(mine) * len(part.popularity[0])}
            if self.plan is not None:
                placed = self.plan.placements[d]
                held = placed.non_expert_bytes + placed.reserve_bytes + resident * self.expert_bytes
                line.update(budget_bytes=self.plan.budgets[d], held_bytes=held)
            lines.append(line)
        return lines

    def summary(self) -> dict:
        placed = [part.placement for part in self.parts]
        on_gpu = sum(p.experts_on_gpu for p in placed if p is not None)
        popularity = np.asarray(self.popularity, dtype=float)
        resident = np.array(self.executor.on_gpu(), dtype=bool)
        hit = float(popularity[resident].sum() / popularity.sum()) if popularity.sum() > 0 else None
        return {
            "experts_on_gpu": on_gpu, "experts_total": int(popularity.size),
            "experts_room": sum(p.experts_room for p in placed if p is not None),
            "gpu_budget_gib": round(sum(part.budget_bytes for part in self.parts) / GIB, 3),
            "expected_gpu_hit_rate": None if hit is None or all(p is None for p in placed) else round(hit, 4),
            "popularity_evenness": None if self.evenness is None else round(self.evenness, 4),
            "devices": self.device_lines(),
        }
