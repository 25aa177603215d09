"""Which layers' experts llama.cpp keeps in RAM: a pure decision from the GGUF's tensor sizes and a GPU budget.

A GGUF holds each layer's routed experts as one tensor per projection, so placement here is per layer, where the
native engine places each expert on its own by popularity. As llama.cpp's `--n-cpu-moe N` does, the first N
layers' experts stay in RAM and every other weight goes to the GPU; the choice is the smallest N whose remaining
experts fit the budget, so a sweep of `-ncmoe` values is a sweep of the same knob.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moedesk.engine.memory_fit import gib

GIB = 2**30
# Routed experts as llama.cpp's converter names them: ffn_{gate,up,down,gate_up}_exps (their .weight and, in
# gpt-oss, .bias); "chexps" are chunked experts. Shared experts (ffn_*_shexp) are not routed: they stay.
EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down|gate_up)_(?:ch)?exps\.")


@dataclass(frozen=True)
class GGUFSizes:
    """Bytes of a GGUF's tensors as its header states them: each layer's routed experts, and the rest."""

    expert_bytes: tuple[int, ...]  # per layer (0 for a layer without routed experts)
    other_bytes: int
    input_bytes: int = 0  # the token embeddings (in other_bytes): llama.cpp keeps them in RAM whatever it offloads

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes) + self.other_bytes


def gguf_sizes(tensors) -> GGUFSizes:
    """tensors: (name, n_bytes, ...) of every tensor in the file."""
    per_layer: dict[int, int] = {}
    other = embeddings = 0
    for name, size, *_ in tensors:
        m = EXPERT_TENSOR.match(name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + int(size)
        else:
            other += int(size)
            embeddings += int(size) if name.startswith("token_embd.") else 0
    layers = max(per_layer, default=-1) + 1
    return GGUFSizes(tuple(per_layer.get(i, 0) for i in range(layers)), other, embeddings)


def cpu_moe_layers(expert_bytes: tuple[int, ...], budget_bytes: int, pinned_extra: int = 0) -> int:
    """The smallest N such that the experts of every layer from N on fit in `budget_bytes` of GPU memory, with
    `pinned_extra` more taken once any layer's experts stay in RAM (llama.cpp's copy of one for a prefill:
    engine.llamacpp.compute)."""
    on_gpu = sum(expert_bytes)
    for n, size in enumerate(expert_bytes):
        if on_gpu + (pinned_extra if n else 0) <= budget_bytes:
            return n
        on_gpu -= size
    return len(expert_bytes)


def expert_budget(gpu_budget_gib: float | None, free_gpu_bytes: int, other_bytes: int, kv_per_position: int,
                  context: int, compute_bytes: int = 0, state_per_sequence: int = 0) -> int:
    """GPU bytes for experts. A budget the user named is the whole GPU's, as for the native engine
    (engine.offload.gpu_budget): the other weights on the GPU, one sequence's KV cache at the whole context and its
    recurrent state (`state_per_sequence`: engine.llamacpp.state), llama.cpp's compute buffer (`compute_bytes`:
    engine.llamacpp.compute) first, experts the rest (ContextBudgetError naming a context that fits when they do
    not); 0 keeps every expert in RAM. No slack is kept inside a named budget, unlike the native engine's: llama.cpp
    allocates each of those buffers whole, once, at the sizes above, and torch's allocator (whose fragmentation and
    workspaces the native engine's slack is for) holds none of them. Else what is free once the same weights and
    compute buffer, KV_ROWS_RESERVED sequences' cache and state and the native engine's margin are set aside
    (engine.offload.orchestration.default_expert_budget)."""
    from moedesk.engine.offload.gpu_budget import split_gpu_budget
    from moedesk.engine.offload.orchestration import KV_ROWS_RESERVED, default_expert_budget

    if gpu_budget_gib == 0:
        return 0
    if gpu_budget_gib is not None:
        return split_gpu_budget(int(gpu_budget_gib * GIB), other_bytes, kv_per_position, context,
                                compute_bytes, kv_per_row=state_per_sequence, slack=0.0).experts
    kv = KV_ROWS_RESERVED * (context * kv_per_position + state_per_sequence)
    return default_expert_budget(max(0, free_gpu_bytes - other_bytes - compute_bytes), kv)


def backed_off_budget(gpu_budget_gib: float | None, free_gpu_bytes: int) -> tuple[float | None, str | None]:
    """A named budget larger than the GPU's free memory, lowered to it (and the line that says so), as the native
    engine lowers its budget on the GPU's out-of-memory: llama.cpp would fail the whole load instead. Unchanged
    where nothing was named or the free memory is unknown (0: torch sees no CUDA device)."""
    if not gpu_budget_gib or free_gpu_bytes <= 0 or gpu_budget_gib * GIB <= free_gpu_bytes:
        return gpu_budget_gib, None
    lowered = free_gpu_bytes / GIB
    return lowered, (f"--gpu-budget {gpu_budget_gib:g}: the GPU has {lowered:.1f} GiB free; placed for "
                     f"{lowered:.1f} GiB")


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp puts the model: `gpu_layers` offloaded (0: none, the CPU build or no GPU), and the first
    `cpu_moe` layers' experts pinned to RAM. `why` is the one line the app shows."""

    gpu_layers: int
    cpu_moe: int
    layers: int
    expert_bytes_in_ram: int
    why: str

    @property
    def page_locked(self) -> bool:
        """Whether llama.cpp reads the file into the GPU's page-locked host memory instead of mapping it: where
        experts stay in RAM beside a GPU, a prefill computes them on the GPU all the same, copying the experts it
        routes to there first, and only from page-locked memory do those copies run at the link's full speed (a
        mapped file's pages go through a staging copy: docs/measurements.md, "Session 46")."""
        return self.gpu_layers > 0 and self.cpu_moe > 0

    def cpu_expert_layers(self) -> list[int]:
        """The layers whose experts are pinned to RAM by a buffer override."""
        return list(range(self.cpu_moe))

    def expert_layer_on_gpu(self, layer: int) -> bool:
        return self.gpu_layers > 0 and layer >= self.cpu_moe

    def experts_on_gpu(self, layers: int) -> list[bool]:
        """Per layer of `layers`: whether its experts are on the GPU."""
        return [self.expert_layer_on_gpu(i) for i in range(layers)]


def place(sizes: GGUFSizes, layers: int, gpu: bool, budget_bytes: int, cpu_moe: int | None = None,
          pinned_extra: int = 0) -> Placement:
    """The placement for a model of `layers` blocks: everything in RAM without a GPU; with one, every layer on it
    and the first `cpu_moe` (chosen for `budget_bytes` when None, `pinned_extra` taken from it once any are
    pinned) layers' experts in RAM, pinned there by a buffer override."""
    total_experts = sum(sizes.expert_bytes)
    if not gpu:  # all in RAM already; experts pinned on request still get their override (what tests check here)
        pinned = max(0, min(cpu_moe or 0, len(sizes.expert_bytes)))
        return Placement(0, pinned, layers, total_experts, "no GPU for llama.cpp: all in RAM")
    if cpu_moe is None:
        cpu_moe = cpu_moe_layers(sizes.expert_bytes, budget_bytes, pinned_extra)
        why = (f"experts of {cpu_moe} of {len(sizes.expert_bytes)} layers in RAM, {gib(budget_bytes)} of the GPU left "
               f"for experts")
    else:
        why = f"experts of the first {cpu_moe} layers in RAM, as asked"
    cpu_moe = max(0, min(cpu_moe, len(sizes.expert_bytes)))
    return Placement(layers + 1, cpu_moe, layers, sum(sizes.expert_bytes[:cpu_moe]), why)


def ram_need(sizes: GGUFSizes, placement: Placement, kv_per_position: int, context: int, slots: int = 1,
             state_per_sequence: int = 0) -> int:
    """Bytes the process holds in RAM once llama.cpp has loaded the model under `placement`: without a GPU the
    whole file and the KV cache (and recurrent state) of `slots` sequences at `context` positions; with one, the
    experts kept in RAM and the token embeddings (the cache is on the GPU with the layers). Beside a GPU the file
    is read, not mapped, wherever experts stay in RAM (`Placement.page_locked`), so no other tensor's pages stay
    with them; with none there, only the embeddings' pages are mapped."""
    if not placement.gpu_layers:
        return sizes.total_bytes + slots * (context * kv_per_position + state_per_sequence)
    return placement.expert_bytes_in_ram + sizes.input_bytes


def backed_off(sizes: GGUFSizes, placement: Placement) -> int | None:
    """After llama.cpp could not allocate its GPU buffers: the cpu_moe that keeps half the layers whose experts
    were on the GPU in RAM instead, None when none were left there to move."""
    on_gpu = [i for i in range(placement.cpu_moe, len(sizes.expert_bytes)) if sizes.expert_bytes[i]]
    if not placement.gpu_layers or not on_gpu:
        return None
    return on_gpu[len(on_gpu) // 2] if len(on_gpu) > 1 else len(sizes.expert_bytes)


def context_backed_off(sizes: GGUFSizes, placement: Placement, short_bytes: int) -> int | None:
    """After llama.cpp loaded the model but could not make its context (KV cache or compute buffer) on the GPU: the
    cpu_moe that keeps at least one more layer's experts in RAM, as many as free `short_bytes` (what the failed
    allocation asked: a context is short by little, so halving as `backed_off` does would give away too much).
    None when no layer's experts were left on the GPU to move."""
    on_gpu = [i for i in range(placement.cpu_moe, len(sizes.expert_bytes)) if sizes.expert_bytes[i]]
    if not placement.gpu_layers or not on_gpu:
        return None
    freed = 0
    for layer in on_gpu:
        freed += sizes.expert_bytes[layer]
        if freed >= short_bytes:
            return layer + 1
    return len(sizes.expert_bytes)


def layer_split(slot_bytes, rooms) -> tuple[int, ...]:
    """How many consecutive slots (llama.cpp's layers, then its output layer) each GPU takes, in order, so that each
    GPU's share of the bytes follows its share of the room: llama.cpp's own split counts layers by free memory, and a
    layer whose experts stay in RAM is a small one. A slot goes to the GPU whose share its middle falls in."""
    slot_bytes, rooms = [max(0, int(b)) for b in slot_bytes], [max(0, int(r)) for r in rooms]
    total, room = sum(slot_bytes), sum(rooms)
    if not rooms:
        return ()
    if room <= 0:
        rooms, room = [1] * len(rooms), len(rooms)  # nothing known: an even split
    ends, held = [], 0
    for r in rooms:
        held += r
        ends.append(held / room * total)
    counts, before, gpu = [0] * len(rooms), 0, 0
    for size in slot_bytes:
        while gpu < len(rooms) - 1 and before + size / 2 > ends[gpu]:
            gpu += 1
        counts[gpu] += 1
        before += size
    return tuple(counts)
