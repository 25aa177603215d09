"""What a GGUF needs in RAM and on the GPU on the llama.cpp engine, under the placement that engine chooses for this
machine's GPU, budget and context: one decision that the load (before llama.cpp reads a weight) and the Models
screen (before anything is loaded) both ask, so that the screen says a model does not fit exactly when its load
refuses it, in the same figures.

`plan` is pure (the header's sizes and a `Machine` in, a `Fit` out); `this_machine` reads the machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moedesk.engine.interface import DEFAULT_CONTEXT
from moedesk.engine.llamacpp.compute import GraphShape, activation_bytes, graph_shape, offload_copy_bytes
from moedesk.engine.llamacpp.placement import (GGUFSizes, Placement, backed_off_budget, expert_budget, gguf_sizes,
                                              layer_split, place, ram_need)
from moedesk.engine.llamacpp.state import recurrent_layers, state_bytes_per_sequence
from moedesk.engine.memory_fit import gib, shortfall
from moedesk.engine.offload.gpu_budget import ContextBudgetError

FIRST_SLOTS = 1  # sequences the context holds at load; serve and batch make room for theirs before they start
CELL_PAD = 256  # llama.cpp rounds a context up to a multiple of this many cache cells
SHORTEST_ADVISED = 512  # a shorter context offered instead is at least this long


def cache_cells(context: int) -> int:
    """The cache cells llama.cpp allocates for `context` positions a sequence."""
    return -(-context // CELL_PAD) * CELL_PAD


@dataclass(frozen=True)
class GGUFShape:
    """What the decision needs of a GGUF, from its header alone."""

    sizes: GGUFSizes
    layers: int  # block_count
    kv_per_position: int  # keys and values of one position in llama.cpp's f16 cache, every attention layer
    trained_context: int | None  # the context it was trained for: llama.cpp allocates no more
    tied_output: bool = False  # no output.weight: llama.cpp puts a copy of the token embeddings where the head runs
    graph: GraphShape | None = None  # what llama.cpp's compute buffer is sized by (None: not counted)
    state_per_sequence: int = 0  # a hybrid model's recurrent state, each sequence (engine.llamacpp.state)

    @property
    def other_on_gpu(self) -> int:
        """The non-expert weights llama.cpp puts on the GPU: all but the token embeddings, which it keeps in RAM
        (a tied head's copy of them aside)."""
        return self.sizes.other_bytes - self.sizes.input_bytes + (self.sizes.input_bytes if self.tied_output else 0)


def gguf_shape(header) -> GGUFShape:
    """The shape of a GGUF from its metadata and tensor infos (gguf's reader, or a split GGUF's joined view)."""
    sizes = gguf_sizes((t.name, int(t.n_bytes)) for t in header.tensors)
    layers = arch_value(header, "block_count") or len(sizes.expert_bytes)
    tied = not any(t.name == "output.weight" for t in header.tensors)
    arch = value(header, "general.architecture")

    def meta(key: str):
        return value(header, f"{arch}.{key}")

    recurrent = recurrent_layers(arch, meta, layers)
    return GGUFShape(sizes, layers, _kv_bytes_per_position(header, layers, recurrent),
                     arch_value(header, "context_length"), tied,
                     graph_shape(header.tensors, arch_value(header, "expert_used_count") or 0),
                     state_bytes_per_sequence(arch, meta, layers))


@dataclass(frozen=True)
class Machine:
    """What placement is decided for."""

    gpu: bool  # llama.cpp offloads to a GPU: its build has one, and --device is not cpu
    gpu_free: int  # bytes free on the GPUs it spreads over, together (0: unknown)
    available: int  # bytes this process may still use (engine.host_memory: RAM, or a cgroup's room)
    gpus: tuple[int, ...] = ()  # each GPU's free bytes, where there are several: llama.cpp spreads over them all
    gpu_index: int | None = None  # the one GPU `--device cuda:N` names, llama.cpp's alone (None: every GPU it sees)

    @property
    def gpu_count(self) -> int:
        return max(1, len(self.gpus))


def llama_gpu() -> tuple[bool, int]:
    """Whether the llama.cpp here offloads to a GPU, and the bytes free on it as torch sees them (0: unknown). No GPU
    where llama.cpp itself is missing: the load then says so in its own line."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.llamacpp.library import library

    try:
        gpu = any(kind in ("gpu", "igpu") for _, kind in library().devices())
    except MoedeskError:
        return False, 0
    return gpu, sum(gpus_free()) if gpu else 0


def gpus_free() -> tuple[int, ...]:
    """Bytes free on each CUDA GPU torch sees: the GPUs llama.cpp's CUDA build spreads over (the same process and
    CUDA_VISIBLE_DEVICES, so the same order); () without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count()))


def named_gpu(device: str) -> int | None:
    """The GPU index `--device` names ("cuda:1": 1); None for "cuda" and "auto" (every GPU llama.cpp sees) and "cpu"."""
    kind, _, index = str(device).partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def this_machine(device: str = "auto", available: int | None = None) -> Machine:
    """This machine as the llama.cpp engine would load on it with `--device device`: with several GPUs, all of them,
    as llama.cpp spreads its layers over every GPU it sees (`gpu_split` says how many each takes); `cuda:N` that GPU
    alone, its free memory the fit's. MoedeskError (one line) for a GPU torch does not see."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.host_memory import available_memory

    gpu, free = llama_gpu()
    gpu = gpu and device != "cpu"
    each = gpus_free() if gpu else ()
    index = named_gpu(device) if gpu else None
    if index is not None and each:  # torch without CUDA sees none: the free memory stays unknown (0)
        if index >= len(each):
            raise MoedeskError(f"--device {device}: no such GPU here (cuda:0 to cuda:{len(each) - 1})")
        each = (each[index],)
        free = each[0]
    available = available_memory() if available is None else available
    return Machine(gpu, free, available, each if len(each) > 1 else (), index)


def gpu_split(shape: GGUFShape, placement: Placement, machine: Machine, context: int) -> tuple[int, ...] | None:
    """llama.cpp's tensor_split for `placement` on several GPUs: the layers (then the output layer) each GPU takes,
    by bytes against each GPU's room once its own compute buffer is set aside (placement.layer_split); None on one
    GPU, where llama.cpp's default is what the plan counts. A layer's share of the non-expert weights and cache is
    taken as even; the output layer as large as the token embeddings (its shape, tied or not)."""
    if len(machine.gpus) < 2 or not placement.gpu_layers:
        return None
    layers, sizes, cells = shape.layers, shape.sizes, cache_cells(context)
    each_layer = (max(0, shape.other_on_gpu - sizes.input_bytes)
                  + FIRST_SLOTS * (cells * shape.kv_per_position + shape.state_per_sequence)) // max(1, layers)
    experts = list(sizes.expert_bytes) + [0] * max(0, layers - len(sizes.expert_bytes))
    slots = [each_layer + (0 if i < placement.cpu_moe else experts[i]) for i in range(layers)] + [sizes.input_bytes]
    compute = activation_bytes(shape.graph, cells) if shape.graph else 0
    return layer_split(slots, [free - compute for free in machine.gpus])


@dataclass(frozen=True)
class Fit:
    """A placement and what it holds where. `problem`: None when it fits, else the shortfall in words (naming a
    shorter context that would fit, where one does); `notes`: what was changed on the way (a budget lowered)."""

    placement: Placement
    context: int  # positions the cache holds
    ram_bytes: int
    gpu_bytes: int  # weights, KV cache and recurrent state: llama.cpp's model, KV and RS buffers on the GPU
    available: int
    problem: str | None
    notes: tuple[str, ...] = ()
    compute_bytes: int = 0  # llama.cpp's compute buffer on the GPU, as estimated (engine.llamacpp.compute)

    @property
    def fits(self) -> bool:
        return self.problem is None

    def refusal(self, what: str) -> str:
        return f"{what} {self.problem}"

    @property
    def gpu_total(self) -> int:
        """All the plan takes on the GPU, its compute buffer included: what a GPU budget is spent on."""
        return self.gpu_bytes + self.compute_bytes

    def summary(self) -> str:
        """"~1.2 GiB in RAM + 0.8 GiB on the GPU at 4096 positions (experts of 2 of 4 layers in RAM ...)"."""
        where = f"~{gib(self.ram_bytes)} in RAM"
        if self.placement.gpu_layers:
            where += f" + {gib(self.gpu_total)} on the GPU"
        return f"{where} at {self.context} positions ({self.placement.why})"

    def line(self) -> str:
        """The summary, and the shortfall where it does not fit: what the Models screen shows."""
        return self.summary() + ("" if self.fits else f" · does not fit: {self.problem}")


def plan(shape: GGUFShape, machine: Machine, context: int | None = None, gpu_budget: float | None = None,
         cpu_moe: int | None = None) -> Fit:
    """Where the llama.cpp engine puts a GGUF of `shape` on `machine` at `context` positions (None: the default,
    within what the model was trained for), for `gpu_budget` GiB (None: what is free), with the first `cpu_moe`
    layers' experts in RAM (None: as few as the budget allows), and whether what stays in RAM fits the memory
    the process may use. ContextBudgetError (one line) where a named budget cannot hold the rest."""
    context = min(context or DEFAULT_CONTEXT, shape.trained_context or context or DEFAULT_CONTEXT)
    gpu_budget, lowered = backed_off_budget(gpu_budget, machine.gpu_free) if machine.gpu else (gpu_budget, None)
    placement, ram, gpu, compute = _placed(shape, machine, context, gpu_budget, cpu_moe)
    shorter = {}
    for c in (context >> n for n in range(1, 8)):
        if c < SHORTEST_ADVISED:
            break
        try:
            shorter[f"--context {c}"] = _placed(shape, machine, c, gpu_budget, cpu_moe)[1]
        except ContextBudgetError:
            continue
    return Fit(placement, context, ram, gpu, machine.available, shortfall(ram, machine.available, shorter),
               (lowered,) if lowered else (), compute)


def _placed(shape: GGUFShape, machine: Machine, context: int, gpu_budget: float | None,
            cpu_moe: int | None) -> tuple[Placement, int, int, int]:
    """(placement, bytes in RAM, weights, cache and state on the GPU, compute buffer on the GPU) at `context`
    positions.
    The budget is spent as llama.cpp spends the GPU: the non-expert weights it puts there, the cache and recurrent
    state, its compute buffer (one expert tensor's copy more once any layer's experts stay in RAM), then experts."""
    sizes, kv, cells, state = shape.sizes, shape.kv_per_position, cache_cells(context), shape.state_per_sequence
    # each GPU llama.cpp spreads over keeps a compute buffer of its own
    activations = (activation_bytes(shape.graph, cells) if shape.graph else 0) * machine.gpu_count
    copy = offload_copy_bytes(shape.graph, cells) if shape.graph else 0
    budget = expert_budget(gpu_budget, machine.gpu_free, shape.other_on_gpu, kv, cells, activations, state) \
        if machine.gpu else 0
    placement = place(sizes, shape.layers, machine.gpu, budget, cpu_moe, copy)
    ram = ram_need(sizes, placement, kv, cells, FIRST_SLOTS, state)
    if not placement.gpu_layers:
        return placement, ram, 0, 0
    gpu = (shape.other_on_gpu + sum(sizes.expert_bytes) - placement.expert_bytes_in_ram
           + FIRST_SLOTS * (cells * kv + state))
    return placement, ram, gpu, activations + (copy if placement.cpu_moe else 0)


def read_header(path: Path):
    """The GGUF's metadata and tensor infos; of a split GGUF, the first part's metadata and every part's tensors
    (engine.load.gguf_split), so that placement sizes the whole model. CheckpointError (one line) for a file gguf's
    reader refuses."""
    from gguf import GGUFReader

    from moedesk.engine.errors import CheckpointError
    from moedesk.engine.load.gguf_split import open_gguf

    def read(part: Path):
        try:
            return GGUFReader(part)
        except Exception as e:  # noqa: BLE001 -- the reader validates by failing
            raise CheckpointError(part, f"not a readable GGUF file "
                                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    return open_gguf(Path(path), read)


# --- the header's values -----------------------------------------------------------------------------------

def value(header, key: str):
    field = header.fields.get(key)
    return field.contents() if field is not None else None


def arch_value(header, key: str) -> int | None:
    found = value(header, f"{value(header, 'general.architecture')}.{key}")
    return int(found) if isinstance(found, int) else None


def _kv_bytes_per_position(header, layers: int, recurrent=()) -> int:
    """Keys and values of one position in llama.cpp's f16 cache, from the header (before anything is loaded). Only
    the layers with attention hold a cache, as llama.cpp allocates it: not the `recurrent` ones (Qwen3.5's Gated
    DeltaNet), nor those whose key/value heads are given per layer as none (LFM2's short convolutions). Latent
    attention (DeepSeek's MLA: key_length_mla and value_length_mla in the file) caches keys alone, its values
    being a view of them."""
    arch = value(header, "general.architecture")

    def widest(key, default):
        found = value(header, f"{arch}.{key}")
        values = found if isinstance(found, list) else [found]
        numbers = [v for v in values if isinstance(v, int)]
        return max(numbers) if numbers else default

    heads = widest("attention.head_count", 1) or 1
    per_layer = value(header, f"{arch}.attention.head_count_kv")
    if not (isinstance(per_layer, list) and all(isinstance(n, int) for n in per_layer)):
        per_layer = [widest("attention.head_count_kv", heads) or heads] * layers
    key = widest("attention.key_length", widest("embedding_length", 0) // heads)
    width = 0 if value(header, f"{arch}.attention.key_length_mla") and value(
        header, f"{arch}.attention.value_length_mla") else widest("attention.value_length", key)
    skipped = set(recurrent)
    return 2 * sum(n for i, n in enumerate(per_layer[:layers]) if i not in skipped) * (key + width)
