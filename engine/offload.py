"""Experts split between GPU memory and (pinned) CPU memory, and the executor that runs them.

Every expert lives in host memory, stacked per layer ([E, 2F, H] gate+up, [E, H, F] down),
pinned when a GPU exists so that copies run at full PCIe speed. The experts a placement puts
on the GPU are copied there once. For each layer step the executor runs resident experts on
the GPU, and for each offloaded expert with tokens either computes it on the CPU or copies it
into a GPU staging slot and computes it there, as `decide` says; CPU work runs while the GPU
works. All of a layer's CPU experts go to `kernels.cpu_experts` in one call: one parallel
region streams their weights, where torch would run one small matmul after another. Outputs
are summed in ascending expert order wherever they were computed, so the result does not
depend on the placement beyond each expert's own arithmetic.

With `device` = cpu the "GPU" tier is simulated on the CPU: placement, decisions, staging
copies and the ordered sum all run for real, which is how CI tests them without a GPU.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields, replace

import torch

from kernels.cpu_experts import expert_forward, experts_forward
from kernels.gpu_experts import grouped_experts_forward, grouped_supported

# Above this many tokens on one resident expert, cuBLAS GEMMs per expert beat a grouped launch's
# savings (EPS-MoE); below it, launches dominate. A choice, not yet a measurement.
GROUPED_MAX_TOKENS = 64

__all__ = ["expert_forward", "experts_forward", "OffloadExecutor", "allocate_banks", "stack_experts"]


@dataclass
class LayerBank:
    gate_up: torch.Tensor  # [E, 2F, H] in host memory
    down: torch.Tensor  # [E, H, F] in host memory
    gpu_slot: list  # expert -> row of gpu_gate_up / gpu_down, or None when offloaded
    gpu_gate_up: torch.Tensor | None = None
    gpu_down: torch.Tensor | None = None


@dataclass
class StepStats:
    """Counts and host-side times of the expert work, summed over the layers of the steps seen."""

    gpu_experts: int = 0  # resident on the GPU, computed there
    copied_experts: int = 0  # copied over PCIe, computed on the GPU
    cpu_experts: int = 0  # computed on the CPU
    cpu_ms: float = 0.0
    wait_ms: float = 0.0  # blocked on the GPU for the routing (the attention and router work before it)
    layer_ms: float = 0.0
    selections: int = 0  # (token, expert) pairs routed
    gpu_hits: int = 0  # of those, served by a resident expert

    def since(self, earlier: "StepStats") -> "StepStats":
        """What was counted between `earlier` (a copy taken then) and now."""
        return StepStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def copy(self) -> "StepStats":
        return replace(self)

    def as_dict(self) -> dict:
        total = self.gpu_experts + self.copied_experts + self.cpu_experts
        return {
            "experts_gpu": self.gpu_experts, "experts_copied": self.copied_experts, "experts_cpu": self.cpu_experts,
            "gpu_hit_rate": round(self.gpu_hits / self.selections, 4) if self.selections else None,
            "cpu_expert_ms": round(self.cpu_ms, 3), "gpu_wait_ms": round(self.wait_ms, 3),
            "moe_ms": round(self.layer_ms, 3), "active_experts": total,
        }


def allocate_banks(model, dtype: torch.dtype, pinned: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Empty host stacks per MoE layer, each expert's parameters made views of them.

    Stacking pins a layer's experts in two allocations (not thousands) and gives the CPU and
    copy paths contiguous [2F, H] and [H, F] blocks; a loader then writes each checkpoint
    tensor straight into its view, so a model larger than the GPU never passes through it.
    """
    banks = {}
    for moe in model.moe_blocks():
        experts = moe.experts
        F_, H = experts[0].gate.weight.shape
        gate_up = torch.empty((len(experts), 2 * F_, H), dtype=dtype, pin_memory=pinned)
        down = torch.empty((len(experts), H, F_), dtype=dtype, pin_memory=pinned)
        for e, expert in enumerate(experts):
            for linear, view in zip((expert.gate, expert.up, expert.down), _expert_views(gate_up[e], down[e])):
                linear.weight = torch.nn.Parameter(view, requires_grad=False)
        banks[moe.layer] = (gate_up, down)
    return banks


def _expert_views(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, down of one expert as views of its rows in the stacks."""
    half = gate_up.shape[0] // 2
    return gate_up[:half], gate_up[half:], down


def stack_experts(model, pinned: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Banks for a model whose experts are already loaded: their weights move into the stacks."""
    old = {moe.layer: [(e.gate.weight, e.up.weight, e.down.weight) for e in moe.experts] for moe in model.moe_blocks()}
    dtype = next(iter(old.values()))[0][0].dtype
    banks = allocate_banks(model, dtype, pinned)
    for layer, (gate_up, down) in banks.items():
        for e, weights in enumerate(old[layer]):
            for view, weight in zip(_expert_views(gate_up[e], down[e]), weights):
                view.copy_(weight)
    return banks


def queue_copy(stream, gate_up, down, staging_gate_up, staging_down, after=None):
    """Queue one expert's host-to-GPU copy on `stream` (after the event `after`); the event that marks it done."""
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        staging_gate_up.copy_(gate_up, non_blocking=True)
        staging_down.copy_(down, non_blocking=True)
        return stream.record_event()


def compute_copied(x, rows, staging_gate_up, staging_down, ready=None):
    """A copied expert's output once its copy (event `ready`) landed, and the event after which its
    staging slot may be overwritten (None on the simulated tier, where everything is synchronous)."""
    if ready is None:
        return expert_forward(x[rows], staging_gate_up, staging_down), None
    current = torch.cuda.current_stream(x.device)
    current.wait_event(ready)
    out = expert_forward(x[rows], staging_gate_up, staging_down)
    return out, current.record_event()


def combine_in_expert_order(y: torch.Tensor, routing: torch.Tensor, weights: torch.Tensor, n: int, k: int):
    """Sum over each token's experts of weight * output, adding in ascending expert order.

    y: the outputs of every (token, slot) pair, grouped by expert in ascending order; routing: rows
    token, slot and dest (the pair's index in a [token, rank] layout). The sequential adds round
    exactly as an index_add_ per expert in ascending order would (the reference's loop), in K
    launches instead of a few per expert.
    """
    weighted = torch.empty((n * k, y.shape[1]), dtype=y.dtype, device=y.device)
    weighted.index_copy_(0, routing[2], y * weights[routing[0], routing[1]].unsqueeze(-1))
    weighted = weighted.view(n, k, -1)
    out = weighted[:, 0].clone()
    for j in range(1, k):
        out += weighted[:, j]
    return out


class OffloadExecutor:
    """Runs each layer's experts where a placement and a per-step decision say."""

    def __init__(self, banks: dict, on_gpu, device, decide, staging_slots: int | None = None):
        """banks: layer -> (gate_up, down) host stacks; on_gpu[i][expert]: resident on the GPU (i-th MoE layer);
        decide(loads: {expert: tokens}) -> (cpu experts, experts to copy)."""
        self.device = torch.device(device)
        self.decide = decide
        self.simulated = self.device.type == "cpu"
        self.banks = {layer: LayerBank(gu, d, [None] * gu.shape[0]) for layer, (gu, d) in banks.items()}
        self.selections: dict[int, torch.Tensor] = {}
        self.stats = StepStats()
        self.set_placement(on_gpu)
        any_bank = next(iter(self.banks.values()))
        slots = staging_slots or any_bank.gate_up.shape[0]
        self.staging = [(torch.empty_like(any_bank.gate_up[0], device=self.device),
                         torch.empty_like(any_bank.down[0], device=self.device)) for _ in range(slots)]
        self.copy_stream = None if self.simulated else torch.cuda.Stream(self.device)
        self.slot_free = [None] * slots  # CUDA event: the last compute that read this staging slot

    def set_placement(self, on_gpu) -> None:
        """Make exactly the experts marked in on_gpu[layer_index][expert] resident on the device."""
        for (layer, bank), row in zip(sorted(self.banks.items()), on_gpu):
            resident = [e for e, flag in enumerate(row) if flag]
            bank.gpu_gate_up = bank.gpu_down = None  # free the old copies before making new ones
            bank.gpu_slot = [None] * len(row)
            if resident:
                index = torch.tensor(resident)
                bank.gpu_gate_up = bank.gate_up[index].to(self.device)
                bank.gpu_down = bank.down[index].to(self.device)
                for slot, e in enumerate(resident):
                    bank.gpu_slot[e] = slot

    def on_gpu(self) -> list[list[bool]]:
        return [[s is not None for s in bank.gpu_slot] for _, bank in sorted(self.banks.items())]

    def run_experts(self, moe, x, weights, ids):
        started = time.perf_counter()
        bank = self.banks[moe.layer]
        ids_host = ids.cpu()  # the one wait per layer: decisions need the routing
        self.stats.wait_ms += (time.perf_counter() - started) * 1e3
        counts = torch.bincount(ids_host.flatten(), minlength=len(bank.gpu_slot))
        seen = self.selections.get(moe.layer)
        self.selections[moe.layer] = counts if seen is None else seen + counts
        active = torch.nonzero(counts).flatten().tolist()
        resident = [e for e in active if bank.gpu_slot[e] is not None]
        offloaded = {e: int(counts[e]) for e in active if bank.gpu_slot[e] is None}
        on_cpu, to_copy = self.decide(offloaded) if offloaded else ([], [])
        assert len(to_copy) <= len(self.staging), "more copies than staging slots in one layer"
        # Fetch activations before any GPU work is queued: the copy waits for the stream to drain.
        x_host = x.cpu() if on_cpu else None

        # (token, top-k slot) pairs grouped by expert: one sort on the host, one small copy to the device.
        # dest: where each pair's output goes in a [token, rank] layout, rank = its expert's place among
        # the token's experts in ascending id order, so the sum below runs in expert order.
        n, k = ids_host.shape
        order = torch.argsort(ids_host.flatten(), stable=True)
        token, slot = order // k, order % k
        rank = (ids_host.unsqueeze(-1) > ids_host.unsqueeze(-2)).sum(-1)
        routing_host = torch.stack([token, slot, token * k + rank[token, slot]])
        routing = routing_host.to(self.device, non_blocking=True)
        ends = torch.cumsum(counts, 0).tolist()
        span = {e: (ends[e] - int(counts[e]), ends[e]) for e in active}

        outputs: dict[int, torch.Tensor] = {}
        # GPU work first: it is queued asynchronously and runs while the CPU computes below.
        copies = self._start_copies(bank, to_copy)
        if resident:
            outputs.update(self._run_resident(bank, x, routing, resident, span))
        for e, (slot, ready) in copies.items():
            a, b = span[e]
            outputs[e], self.slot_free[slot] = compute_copied(x, routing[0, a:b], *self.staging[slot], ready)
        if on_cpu:
            cpu_started = time.perf_counter()
            groups = [span[e] for e in on_cpu]
            rows = torch.cat([routing_host[0, a:b] for a, b in groups])
            offsets = torch.tensor([0, *itertools.accumulate(b - a for a, b in groups)])
            host_out = self._host_buffer(rows.shape[0], x.shape[1], x.dtype)
            experts_forward(x_host, rows, torch.tensor(on_cpu), offsets, bank.gate_up, bank.down, out=host_out)
            back = host_out.to(self.device, non_blocking=True)  # one copy back for all CPU experts
            for e, a, b in zip(on_cpu, offsets[:-1].tolist(), offsets[1:].tolist()):
                outputs[e] = back[a:b]
            self.stats.cpu_ms += (time.perf_counter() - cpu_started) * 1e3

        out = combine_in_expert_order(torch.cat([outputs[e] for e in active]), routing, weights, n, k)
        s = self.stats
        s.gpu_experts += len(resident)
        s.copied_experts += len(to_copy)
        s.cpu_experts += len(on_cpu)
        s.selections += int(counts.sum())
        s.gpu_hits += int(sum(counts[e] for e in resident))
        s.layer_ms += (time.perf_counter() - started) * 1e3
        return out

    def _run_resident(self, bank: LayerBank, x, routing, resident: list[int], span: dict) -> dict:
        """Outputs of the GPU-resident experts: one grouped launch per projection while every expert has
        at most GROUPED_MAX_TOKENS tokens (decode), else one GEMM per expert (prefill's large loads)."""
        sizes = [span[e][1] - span[e][0] for e in resident]
        if max(sizes) > GROUPED_MAX_TOKENS or not grouped_supported(x, bank.gpu_gate_up):
            outputs = {}
            for e in resident:
                a, b = span[e]
                s = bank.gpu_slot[e]
                outputs[e] = expert_forward(x[routing[0, a:b]], bank.gpu_gate_up[s], bank.gpu_down[s])
            return outputs
        # Slots hold the resident experts in ascending id order, so groups follow the slots.
        tokens = [0] * bank.gpu_gate_up.shape[0]
        for e, n in zip(resident, sizes):
            tokens[bank.gpu_slot[e]] = n
        pairs = torch.cat([torch.arange(*span[e]) for e in resident])
        index = torch.cat([pairs, torch.tensor(tokens).cumsum(0)]).to(self.device, non_blocking=True)
        pairs, ends = index[:len(pairs)], index[len(pairs):].to(torch.int32)
        y = grouped_experts_forward(x[routing[0, pairs]], bank.gpu_gate_up, bank.gpu_down, ends)
        starts = itertools.accumulate(sizes, initial=0)
        return {e: y[a:a + n] for e, a, n in zip(resident, starts, sizes)}

    def _host_buffer(self, rows: int, hidden: int, dtype) -> torch.Tensor:
        """A reused (pinned, with a GPU) buffer for CPU expert outputs; it grows, never shrinks.

        Safe to reuse: the next layer begins by waiting for the stream, so last layer's copy is done.
        """
        buf = getattr(self, "_host_out", None)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != hidden or buf.dtype != dtype:
            buf = torch.empty((max(rows, 64), hidden), dtype=dtype, pin_memory=not self.simulated)
            self._host_out = buf
        return buf[:rows]

    def _start_copies(self, bank: LayerBank, experts) -> dict:
        """Queue host-to-GPU copies of `experts` into staging slots; expert -> (slot, ready event)."""
        started = {}
        for i, e in enumerate(experts):
            slot = i % len(self.staging)
            gate_up, down = self.staging[slot]
            if self.simulated:
                gate_up.copy_(bank.gate_up[e])
                down.copy_(bank.down[e])
                started[e] = (slot, None)
                continue
            started[e] = (slot, queue_copy(self.copy_stream, bank.gate_up[e], bank.down[e], gate_up, down,
                                           after=self.slot_free[slot]))
        return started
