"""Turn an opened checkpoint into a Transformer on a device, tensor by tensor."""
from __future__ import annotations

import ctypes
import functools
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from moedesk.engine.model.architectures import is_ignored_tensor, map_weight_name, parse_config, weight_name_map
from moedesk.engine.model import packed_linear
from moedesk.engine.model.embedding import keep_in_host, table_in_host
from moedesk.engine.model.config import ModelConfig
from moedesk.engine.errors import CheckpointError, MoedeskError, UnsupportedModelError
from moedesk.engine.model.transformer import Transformer
from moedesk.kernels import cpu_experts
from moedesk.kernels.expert_weights import DENSE, ExpertWeights
from moedesk.kernels.quant_formats import QUANTIZE_TO, packed_format, quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoedeskError(f"--device {device}: no CUDA GPU is available")
    return torch.device(device)


def default_dtype(device_type: str, bf16_on_each_gpu) -> torch.dtype:
    """The weights dtype when none is named: float32 on the CPU (16-bit matmuls are slow on most CPUs), bfloat16
    where every GPU the model runs on has it (one layer's weights are one dtype wherever they run), else float16."""
    if device_type == "cpu":
        return torch.float32
    return torch.bfloat16 if all(bf16_on_each_gpu) else torch.float16


def resolve_dtype(dtype: str | None, device: torch.device, devices=None) -> torch.dtype:
    """`dtype` named, or the default for `device` and every one of `devices` (a spread's GPUs) it runs on."""
    if dtype is None:
        gpus = [torch.device(d) for d in (devices or [device]) if torch.device(d).type == "cuda"]
        return default_dtype(device.type, (_bf16_supported(d) for d in gpus))
    if dtype not in DTYPES:
        raise MoedeskError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _bf16_supported(device: torch.device) -> bool:
    # torch asks the current device: made `device` for the question ("cuda" stays the current one, as before)
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()


def load_model(checkpoint, dtype: torch.dtype, device: torch.device, context_length: int | None = None,
               progress=None, expert_banks=None, expert_dtype: str = "auto", threads: int | None = None,
               timings: dict | None = None, layer_devices=None) -> tuple[Transformer, ModelConfig, dict]:
    """Build the model on the meta device, then fill it with the checkpoint's tensors one at a time.

    Routed experts become one `ExpertWeights` stack per MoE layer, in the formats `expert_formats` picks
    (`expert_dtype`: auto keeps packed GGUF blocks as they are; int8/int4 quantise float experts while
    they load, one tensor at a time; bf16 keeps everything in `dtype`, where auto may keep a float32 CPU load's
    bfloat16 experts in bfloat16: `expert_stack_dtype`). expert_banks(model, formats) ->
    banks, when given, allocates those stacks in host memory (engine.offload.pinned_memory.HostBanks): expert
    tensors are written straight into them and only the rest goes to `device`. If expert_banks also has
    `filled(layer)` it is called once each layer's experts are all written, and `done(ok)` once at the end
    (engine.offload.pinned_memory.HostBanks page-locks each layer there while the next one fills).
    threads: how many expert tensors are copied at once (default_load_threads; 1 where the checkpoint's reads
    are not thread-safe). timings, when given, gets the seconds each part took (build, plain, experts,
    banks_done). layer_devices(model, cfg, banks) -> a torch device per transformer layer, or None: asked once the
    banks say what an expert takes, before any other weight is read, so that each layer's weights go straight to
    its own device (the embeddings to `device`, the final norm and head to the last layer's), never through
    `device` (engine.model.layer_devices then has nothing left to move). Returns (model, config, banks); banks is {}
    without expert_banks.
    """
    if expert_dtype not in EXPERT_DTYPES:
        raise MoedeskError(f"--expert-dtype {expert_dtype}: choose one of {', '.join(EXPERT_DTYPES)}")
    timings = {} if timings is None else timings
    clock = time.perf_counter()
    path = checkpoint.path
    if (dequantise_in := getattr(checkpoint, "dequantise_in", None)) is not None:
        # a quantised release's weights computed straight into the model's dtype, where it runs
        # (engine.load.fp8_blocks, engine.load.compressed_tensors)
        dequantise_in(dtype, device)
    cfg = parse_config(checkpoint.config, path, tensors=checkpoint.shapes())
    max_positions = min(context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    with torch.device("meta"):
        model = Transformer(cfg, max_positions)
    expected = dict(model.named_parameters())
    rules = weight_name_map(cfg)
    # Each tensor is released once used, so the checkpoint can unmap what was read (GGUF reads without maps).
    release = getattr(checkpoint, "release", lambda name: None)
    plain, experts = [], {}  # experts: (layer, expert, projection) -> checkpoint name
    for name in checkpoint.keys():
        if is_ignored_tensor(name, cfg):
            release(name)
            continue
        ours = map_weight_name(rules, name)
        routed = ROUTED_EXPERT.fullmatch(ours) if ours else None
        if routed:
            layer, e, proj = routed.groups()
            experts[int(layer), int(e), proj] = name
        elif ours is None or ours not in expected:
            raise UnsupportedModelError(path, f"unexpected tensor {name} for a {cfg.arch} model")
        else:
            plain.append((name, ours))
    moes = {moe.layer: moe for moe in model.moe_blocks()}
    missing = [f"layers.{layer}.moe.experts.{e}.{proj}.weight" for layer in moes for e in range(cfg.num_experts)
               for proj in _PROJECTIONS if (layer, e, proj) not in experts]
    unknown = [name for (layer, e, _), name in experts.items() if layer not in moes or e >= cfg.num_experts]
    if unknown:
        raise UnsupportedModelError(path, f"unexpected tensor {unknown[0]} for a {cfg.arch} model")
    formats = {layer: expert_formats(checkpoint, experts, layer, cfg, expert_dtype) for layer in moes}
    if expert_banks and cfg.is_moe:
        banks = expert_banks(model, formats)
    else:
        banks = {}
        for layer, moe in moes.items():
            stack_dtype = expert_stack_dtype(checkpoint, experts, layer, cfg, expert_dtype, formats[layer], dtype,
                                             torch.device(device).type)
            moe.experts = ExpertWeights.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                              dtype=stack_dtype, gate_up_format=formats[layer][0],
                                              down_format=formats[layer][1], device=device)
    total, done = len(plain) + len(experts), 0
    keep_packed = packed_weights(checkpoint, model) if packed_linear.wanted(device) else None
    loaded = set()
    spread = layer_devices(model, cfg, banks) if layer_devices is not None and banks else None
    target = _parameter_device(device, spread)
    # The token table in pinned RAM where the banks pin theirs (engine.model.embedding), else on the device
    pinned_copy = getattr(expert_banks, "pinned_copy", None) if banks else None
    host_table = pinned_copy is not None and table_in_host(cfg, target("embed.weight"))
    clock = _lap(timings, "build", clock)
    freed = FreedMemory()
    for name, ours in plain:
        done += 1
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            release(name)
            continue
        where = target(ours)
        if keep_packed is not None and keep_packed(name, ours):
            rows = checkpoint.read_packed_rows(name)
            if rows is not None:
                _set_packed(model, path, name, ours, rows, checkpoint.packed_format(name), expected[ours].shape,
                            where, model.parameter_dtype(ours, dtype))
                del rows
                release(name)
                loaded.add(ours)
                if progress:
                    progress("load", done / total)
                continue
        if dequantise_in is not None and spread is not None:
            dequantise_in(dtype, where)  # a quantised release's weight computed on the device it stays on
        tensor = checkpoint.get_tensor(name)
        _check_shape(path, name, tensor.shape, expected[ours].shape)
        _check_dtype(path, name, tensor)
        in_host = None
        if ours == "embed.weight" and host_table:  # an exact-size pinned copy, its rows read by the GPU
            in_host = pinned_copy(tensor.to(dtype=model.parameter_dtype(ours, dtype)))
        if in_host is not None:
            keep_in_host(model.embed, in_host, where)
        else:  # (a refused lock leaves the table on the device)
            _set_parameter(model, ours, tensor.to(device=where, dtype=model.parameter_dtype(ours, dtype)))
        if ours == "embed.weight" and cfg.tie_word_embeddings and not _same_device(target("lm_head.weight"), where):
            # Layers spread over devices: a tied head is a copy of the table on the last layer's device, made here
            # from the checkpoint's tensor, never through the first device's copy.
            head = target("lm_head.weight")
            _set_parameter(model, "lm_head.weight",
                           tensor.to(device=head, dtype=model.parameter_dtype("lm_head.weight", dtype)))
            loaded.add("lm_head.weight")
        del tensor
        release(name)
        loaded.add(ours)
        freed.loaded(expected[ours].numel() * model.parameter_dtype(ours, dtype).itemsize)
        if progress:
            progress("load", done / total)
    if dequantise_in is not None and spread is not None:
        dequantise_in(dtype, device)  # experts: dequantised where the load began, as on one device
    freed.now()
    clock = _lap(timings, "plain", clock)
    filled = getattr(expert_banks, "filled", None) if banks else None
    finished = getattr(expert_banks, "done", None) if banks else None

    def landed(n: int) -> None:
        # 1.0 only once the banks are done too: "load done" means the experts are ready to be copied from
        if progress and done + n < total:
            progress("load", (done + n) / total)

    try:
        # Quantising on the CPU is compute-bound and each torch op already spreads over the cores: one tensor at
        # a time, since each loading thread keeps its own temporaries (and glibc arena) resident.
        # (auto quantises an FP8 release's experts: the formats say, not the option; packed GGUF blocks are copied,
        # one reader at a time anyway)
        quantised = {f for pair in formats.values() for f in pair} & set(QUANTIZE_TO.values())
        quantising_on_cpu = torch.device(device).type == "cpu" and bool(quantised)
        threads = 1 if quantising_on_cpu else _load_threads(checkpoint, threads)
        _fill_experts(checkpoint, experts, moes, device, filled, threads, landed)
    except BaseException:
        if finished:
            finished(False)
        raise
    clock = _lap(timings, "experts", clock)
    if finished:
        finished(True)
    _lap(timings, "banks_done", clock)
    if progress and experts:
        progress("load", 1.0)
    checkpoint.close()
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded) + missing
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(path, f"missing tensors: {', '.join(missing[:3])}{more}")
    for moe in model.moe_blocks():  # gpt-oss's biases and activation travel with the experts' stacks
        moe.experts = moe.join_expert_function(moe.experts)
        if moe.layer in banks:
            banks[moe.layer] = moe.join_expert_function(banks[moe.layer])
    model.rotary.to(device)  # its tables are real already (Rotary)
    model.fuse_projections()
    return model.eval(), cfg, banks


def packed_weights(checkpoint, model: nn.Module) -> Callable[[str, str], bool] | None:
    """Where packed weights are wanted (packed_linear.wanted): whether a checkpoint tensor (its name, ours) is kept
    packed, by a PackedLinear in place of its Linear (engine.model.packed_linear). None for checkpoints that cannot
    hand over packed rows (safetensors)."""
    if not hasattr(checkpoint, "read_packed_rows"):
        return None

    def keep(name: str, ours: str) -> bool:
        owner = model.get_submodule(ours.rpartition(".")[0])
        return isinstance(owner, nn.Linear) and _packed_format(checkpoint, name, ours, owner.in_features) is not None

    return keep


def _packed_format(checkpoint, name: str, ours: str, in_features: int) -> str | None:
    """The format a weight stays packed in (a Linear's weight `ours` of `in_features` columns), or None."""
    if not packed_linear.packable(ours):  # first: a split checkpoint's derived names (Qwen3-Next's in_proj_b) are not
        return None                       # the file's, and none of them is packable
    fmt = checkpoint.packed_rows_format(name)
    return fmt if packed_linear.keeps(ours, fmt, in_features) else None


def packed_plan(checkpoint, cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """What a load that keeps packed weights (packed_linear.wanted) keeps packed of `checkpoint`, before reading a
    weight: our name -> (format, rows, columns), as engine.model.packed_linear.plan_of says of the loaded model (the
    GPU budget's early sizes)."""
    if not hasattr(checkpoint, "packed_rows_format"):
        return {}
    rules, shapes, plan = weight_name_map(cfg), checkpoint.shapes(), {}
    for name in checkpoint.keys():
        if is_ignored_tensor(name, cfg):
            continue
        ours = map_weight_name(rules, name)
        shape = shapes.get(name, ())
        if ours is None or ROUTED_EXPERT.fullmatch(ours) or len(shape) != 2 \
                or (ours == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        fmt = _packed_format(checkpoint, name, ours, shape[1])
        if fmt is not None:
            plan[ours] = (fmt, shape[0], shape[1])
    return plan


def _set_packed(model: nn.Module, path, name: str, ours: str, rows: torch.Tensor, fmt: str, shape, device,
                dtype: torch.dtype) -> None:
    out_features, in_features = shape
    if rows.shape != (out_features, packed_format(fmt).row_bytes(in_features)):
        raise CheckpointError(path, f"tensor {name} has {rows.shape[0]} {fmt} rows of {rows.shape[1]} bytes, the config "
                                    f"implies {out_features} rows of {in_features} weights")
    packed_linear.replace_linear(model, ours, rows.to(device), fmt, in_features, dtype)


def _parameter_device(device: torch.device, layer_devices) -> Callable[[str], torch.device]:
    """Where a parameter (by its name in the model) is first put: `device`, or with a device per layer, its layer's;
    the final norm and the head go to the last layer's (where engine.model.layer_devices runs them)."""
    if layer_devices is None:
        return lambda name: device
    layer_devices = [torch.device(d) for d in layer_devices]

    def where(name: str) -> torch.device:
        part, _, rest = name.partition(".")
        if part == "layers":
            return layer_devices[int(rest.partition(".")[0])]
        return layer_devices[-1] if part in ("norm", "lm_head") else device

    return where


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device ("cuda" is the current GPU: index 0 unless set)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def default_load_threads() -> int:
    """Expert tensors copied at once: MOEDESK_LOAD_THREADS, else 4 (capped by the cores). Each copy is itself
    split over torch's threads; several at once keep the cores busy across one tensor's end and the next's
    start, and fault in the banks' fresh pages from several threads."""
    wanted = os.environ.get("MOEDESK_LOAD_THREADS")
    if wanted:
        try:
            return max(1, int(wanted))
        except ValueError:
            raise MoedeskError(f"MOEDESK_LOAD_THREADS={wanted}: expected a whole number") from None
    return max(1, min(4, os.cpu_count() or 1))


def _load_threads(checkpoint, threads: int | None) -> int:
    if not getattr(checkpoint, "concurrent_reads", False):  # e.g. GGUF: one file position shared by its reads
        return 1
    return default_load_threads() if threads is None else max(1, threads)


def _fill_experts(checkpoint, experts: dict, moes: dict, device, filled, threads: int, progress) -> None:
    """Every routed expert tensor into its layer's stack, layer after layer; filled(layer) once a layer is whole."""
    # Layer by layer, so each layer is finished (and can be page-locked) while the next one is read.
    order = sorted(experts.items())
    left = {}
    for (layer, _, _), _ in order:
        left[layer] = left.get(layer, 0) + 1

    release = getattr(checkpoint, "release", lambda name: None)

    def one(key, name):
        layer, e, proj = key
        _load_expert_tensor(checkpoint, name, moes[layer].experts, e, proj, device)
        release(name)
        return layer

    count, freed = 0, FreedMemory()

    def landed(layer):
        nonlocal count
        count += 1
        left[layer] -= 1
        freed.loaded(moes[layer].experts.expert_bytes // len(_PROJECTIONS))
        if left[layer] == 0:
            freed.now()
            if filled:
                filled(layer)
        if progress:
            progress(count)

    if threads <= 1:
        for key, name in order:
            landed(one(key, name))
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="moedesk-load") as pool:
        futures = [pool.submit(one, key, name) for key, name in order]
        try:
            for future in futures:  # in order, so layers are reported whole in order too
                landed(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise


# Weights' bytes loaded between two returns of the freed memory: often enough that temporaries never pile up, rarely
# enough that a whole model's load pays little for the trims (docs/measurements.md, "Session 58").
TRIM_EVERY_BYTES = 16 << 20


class FreedMemory:
    """Gives the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere) every
    TRIM_EVERY_BYTES of weights loaded. A tensor's temporaries (a quantised release dequantised, then packed again) are
    freed into the allocator's arenas, which keep them resident: without this the load's peak and the memory it left
    wandered from run to run, past the bound tests/load/test_packed_memory.py holds them to."""

    def __init__(self):
        self.since = 0

    def loaded(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since >= TRIM_EVERY_BYTES:
            self.now()

    def now(self) -> None:
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
        self.since = 0


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _lap(timings: dict, part: str, since: float) -> float:
    now = time.perf_counter()
    timings[part] = timings.get(part, 0.0) + now - since
    return now


EXPERT_DTYPES = ("auto", "bf16", "int8", "int4")
ROUTED_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)\.weight")
_PROJECTIONS = ("gate", "up", "down")


def expert_formats(checkpoint, experts: dict, layer: int, cfg: ModelConfig, expert_dtype: str) -> tuple[str, str]:
    """(gate_up, down) storage formats of one layer's experts (kernels.quant_formats names, or "dense").

    auto: a matrix stays packed where every expert's tensors of it are stored in one packed format (gate
    and up must share it, being one matrix here); anything else is dense, except experts released quantised
    (engine.load.fp8_blocks, engine.load.compressed_tensors), which auto takes as the checkpoint's `released_as`
    says: FP8 as int8 (q8_0 keeps the byte a weight the user downloaded, where 16-bit experts would double it,
    and rounds more finely than the FP8 blocks did), 4-bit integers as int4. int8 / int4: what would be dense
    is quantised to q8_0 / q4_0 instead (where its rows are whole blocks); packed experts stay as they are.
    bf16: everything dense, in the model's dtype (float32 on the CPU: see `expert_stack_dtype` for auto's).
    """
    if expert_dtype == "auto":
        expert_dtype = _released_as(checkpoint, experts, layer, cfg.num_experts) or "auto"

    def stored(projections) -> str:
        found = {checkpoint.packed_format(experts[layer, e, p]) for e in range(cfg.num_experts) for p in projections
                 if (layer, e, p) in experts}
        return found.pop() if len(found) == 1 and None not in found else DENSE

    if expert_dtype == "bf16":
        return DENSE, DENSE
    chosen = [stored(("gate", "up")), stored(("down",))]
    if expert_dtype in QUANTIZE_TO:
        target = packed_format(QUANTIZE_TO[expert_dtype])
        for i, k in enumerate((cfg.hidden_size, cfg.moe_intermediate_size)):
            if chosen[i] == DENSE and k % target.block == 0:
                chosen[i] = target.name
    return chosen[0], chosen[1]


def expert_stack_dtype(checkpoint, experts: dict, layer: int, cfg: ModelConfig, expert_dtype: str,
                       formats: tuple[str, str], dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype of a layer's dense expert stacks: the model's, except on a float32 CPU load with `--expert-dtype
    auto`, where experts the checkpoint stores in bfloat16 stay in it if kernels/cpu_experts.c can compute them on
    this CPU: half the bytes a token reads and half the RAM, nothing rounded (the executor casts each layer's tokens
    to them and back; `--expert-dtype bf16` keeps float32's arithmetic). checkpoint: anything with
    tensor_dtype(name) (a safetensors dtype name), or without it (kept in `dtype`)."""
    plain = not cfg.expert_bias and not cfg.swiglu_limit  # what the kernel computes: down(silu(gate) * up)
    if (expert_dtype != "auto" or device_type != "cpu" or dtype != torch.float32 or formats != (DENSE, DENSE)
            or not plain or not cpu_experts.cpu_runs_it()):
        return dtype
    names = [experts[key] for key in ((layer, e, p) for e in range(cfg.num_experts) for p in _PROJECTIONS)
             if key in experts]
    return torch.bfloat16 if names and all(stored_as(checkpoint, n) == "BF16" for n in names) else dtype


def stored_as(checkpoint, name: str) -> str | None:
    """checkpoint.tensor_dtype(name), or None where the checkpoint cannot say without reading."""
    try:
        return checkpoint.tensor_dtype(name)
    except (AttributeError, KeyError):  # no tensor_dtype, or a name the checkpoint joins or splits itself
        return None


def _released_as(checkpoint, experts: dict, layer: int, count: int) -> str | None:
    """The wider of what the checkpoint says a layer's quantised experts are released as (int8 over int4)."""
    released_as = getattr(checkpoint, "released_as", None)
    if released_as is None:
        return None
    found = {released_as(experts[layer, e, p]) for e in range(count) for p in _PROJECTIONS if (layer, e, p) in experts}
    return "int8" if "int8" in found else "int4" if "int4" in found else None


def _load_expert_tensor(checkpoint, name: str, w: ExpertWeights, e: int, proj: str, device) -> None:
    """One checkpoint tensor (an expert's gate, up or down) into its rows of the layer's stack: packed bytes
    copied as they are, float weights cast or quantised to the stack's format."""
    width = w.width
    fmt = w.down_format if proj == "down" else w.gate_up_format
    rows = {"gate": w.gate_up[e, :width], "up": w.gate_up[e, width:], "down": w.down[e]}[proj]
    if fmt != DENSE and checkpoint.packed_format(name) == fmt:
        if rows.is_cpu:
            checkpoint.read_packed(name, rows)
        else:
            staged = torch.empty(rows.shape, dtype=torch.uint8)
            checkpoint.read_packed(name, staged)
            rows.copy_(staged)
        return
    tensor = checkpoint.get_tensor(name)
    k = w.hidden if proj != "down" else width
    _check_shape(checkpoint.path, name, tensor.shape, (rows.shape[0], k))
    _check_dtype(checkpoint.path, name, tensor)
    if fmt == DENSE:
        rows.copy_(tensor.to(rows.dtype))  # the stack's: bfloat16 experts of a float32 CPU load stay bfloat16
    elif torch.device(device).type == "cpu":
        # A few rows at a time: quantize's float32 temporaries of a whole tensor were much of a load's peak.
        step = max(1, _QUANTIZE_CHUNK // k)
        for start in range(0, rows.shape[0], step):
            rows[start:start + step].copy_(quantize(tensor[start:start + step], fmt))
    else:  # quantised where it will be computed (the GPU is much faster at it), one tensor at a time
        rows.copy_(quantize(tensor.to(device), fmt))


_QUANTIZE_CHUNK = 1 << 18  # weights quantised at once on the CPU (1 MiB of float32)


def _check_shape(path, name: str, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(path, f"tensor {name} has shape {tuple(shape)}, the config implies {tuple(expected)}")


def _check_dtype(path, name: str, tensor: torch.Tensor) -> None:
    # Weights are floats: integer or boolean values (a mislabelled or quantised-without-scales tensor) would be
    # cast to floats without a word and give a model that runs and talks nonsense.
    if not tensor.is_floating_point():
        raise CheckpointError(path, f"tensor {name} holds {str(tensor.dtype).removeprefix('torch.')} values, "
                                    f"not floating-point weights")
    if tensor.element_size() == 1:  # fp8 read without its block scales (no fp8 quantization_config says they exist)
        raise CheckpointError(path, f"tensor {name} holds {str(tensor.dtype).removeprefix('torch.')} values without "
                                    f"their scales (the config has no fp8 quantization_config)")


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
