"""How much memory a model takes once loaded, from its config and tensor list alone: no weight is read.

The models screen and the download wizard show this before anything is loaded (or downloaded), so it
must follow what the loader will do rather than the file's size: a 16-bit checkpoint loaded with
`--expert-dtype int4` keeps its experts in Q4_0 blocks (18 bytes per 32 weights), a quarter and a bit
of the file; a GGUF's packed experts stay as the file holds them. So the experts' formats are chosen
by the loader's own `expert_formats` and their stacks sized by `ExpertWeights` itself (on the meta
device), and the tensors are sorted into routed experts and the rest by the architectures' own
name map: an estimate that disagrees with a load is a bug in one place, not two.

Weights only: the KV cache, activations and the runtime's own buffers come on top.
"""
from __future__ import annotations

import math
import re
import struct
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from moedesk.engine import json_read
from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.load.loader import (ROUTED_EXPERT, DTYPES, EXPERT_DTYPES, expert_formats, expert_stack_dtype,
                                       stored_as)
from moedesk.engine.model.architectures import (TEXT_MODELS, is_ignored_tensor, map_weight_name, parse_config,
                                                 text_config, weight_name_map)
from moedesk.engine.model.config import ModelConfig
from moedesk.engine.memory_fit import packed_savings
from moedesk.engine.model import packed_linear
from moedesk.engine.model.embedding import table_bytes, table_stays_in_host
from moedesk.engine.model.transformer import parameter_dtype
from moedesk.kernels.expert_weights import DENSE, ExpertWeights
from moedesk.kernels.quant_formats import FORMATS

_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# Stored forms that `--expert-dtype auto` quantises as they load (engine.load.compressed_tensors.Stored.label)
_RELEASED_AS = {"F8_E4M3": "int8", "int8": "int8", "int4": "int4"}


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its file's header describes it."""

    shape: tuple[int, ...]  # in the Hub's layout (one expert's slice for a GGUF's stacked experts)
    # A safetensors dtype (BF16, F32...), or a kernels.quant_formats name (q4_k...) for GGUF blocks that
    # experts are computed from as they are; any other GGUF tensor's GGML type name (BF16, F16, Q5_0...), read
    # as float and converted.
    stored: str


@dataclass(frozen=True)
class MemoryEstimate:
    expert_bytes: int  # routed experts: in RAM (pinned) whenever they are offloaded, as on any GPU
    other_bytes: int  # the rest (attention, router, shared experts, embeddings): on the GPU when there is one
    expert_formats: tuple[str, ...]  # what the experts' stacks hold: "q4_0", "q6_k", "bf16"... (dense ones by dtype)
    weights_dtype: str  # what everything not packed is held in
    # Of other_bytes, the token table where it stays in RAM beside a GPU (engine.model.embedding.table_stays_in_host)
    table_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.other_bytes

    def ram_bytes(self, gpu: bool) -> int:
        # On a GPU only the experts and the token table stay in RAM (a dense model has none, and runs on the GPU whole).
        return self.expert_bytes + self.table_bytes if gpu else self.total_bytes

    def gpu_bytes(self, gpu: bool) -> int:
        return self.other_bytes - self.table_bytes if gpu else 0

    @property
    def experts_as(self) -> str:
        """The experts' form in a few characters: "q4_0", "q4_k/q6_k", "q4_0/f32" (down projections left 16-bit)."""
        return "/".join(self.expert_formats)


@dataclass
class ModelWeights:
    """A checkpoint's tensors sorted the way the loader sorts them; `estimate` sizes them for an expert dtype.

    Sorting is the slow part (a regex walk over every tensor name: tens of thousands for a large MoE), so
    screens keep one of these per model and ask `estimate` again whenever a setting changes.
    """

    config: ModelConfig
    other_params: int  # parameters of every tensor the loader keeps in the weights dtype
    experts: dict  # (layer, expert, "gate" | "up" | "down") -> checkpoint name, as the loader's own map
    stored: dict  # checkpoint name -> TensorInfo.stored, for the routed experts
    float32_params: int = 0  # parameters kept in float32 whatever the weights dtype (a sigmoid router's)
    # Of other_params, what a load that keeps packed weights (engine.model.packed_linear.wanted) keeps packed: our
    # name -> (format, rows, columns), as engine.load.loader.packed_plan says of the file
    packed: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)
    # Of a GGUF: its general.architecture and engine.llamacpp.fit.GGUFShape, so that a screen can plan the file
    # for the llama.cpp engine too where the engine setting asks for it
    arch: str = ""
    llama_shape: object = field(default=None, compare=False, repr=False)

    def packed_format(self, name: str) -> str | None:
        """What `engine.load.loader.expert_formats` asks a checkpoint."""
        fmt = self.stored[name]
        return fmt if fmt in FORMATS else None

    def tensor_dtype(self, name: str) -> str:
        """What `expert_stack_dtype` asks, as of a SafetensorsCheckpoint: a routed expert's stored form."""
        return self.stored[name]

    def released_as(self, name: str) -> str | None:
        """What `expert_formats` asks a quantised release (engine.load.fp8_blocks, engine.load.compressed_tensors)."""
        return _RELEASED_AS.get(self.stored[name])

    def estimate(self, expert_dtype: str = "auto", weights_dtype: str = "bfloat16", gpu: bool = False) -> MemoryEstimate:
        """The weights' bytes once loaded with `--expert-dtype expert_dtype` and `--dtype weights_dtype`
        (float32, bfloat16 or float16: what `auto` resolves to on the device that will load it), with a GPU or
        on the CPU alone (where a float32 load keeps bfloat16 experts: engine.load.loader.expert_stack_dtype)."""
        if expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert dtype {expert_dtype!r}: choose one of {', '.join(EXPERT_DTYPES)}")
        key = (expert_dtype, weights_dtype, gpu)
        if key not in self._cache:
            self._cache[key] = self._estimate(expert_dtype, weights_dtype, "cuda" if gpu else "cpu")
        return self._cache[key]

    def _estimate(self, expert_dtype: str, dtype_name: str, device_type: str) -> MemoryEstimate:
        cfg, dtype = self.config, DTYPES[dtype_name]
        element = torch.empty((), dtype=dtype).element_size()
        expert_bytes, formats = 0, set()
        for layer in range(cfg.num_layers):
            if not cfg.is_moe_layer(layer):
                continue
            gate_up, down = expert_formats(self, self.experts, layer, cfg, expert_dtype)
            stack_dtype = expert_stack_dtype(self, self.experts, layer, cfg, expert_dtype, (gate_up, down), dtype,
                                             device_type)
            stack = ExpertWeights.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                        dtype=stack_dtype, gate_up_format=gate_up, down_format=down, device="meta")
            expert_bytes += stack.nbytes
            dense = _SHORT_DTYPES[str(stack_dtype).removeprefix("torch.")]
            formats.update(dense if f == DENSE else f for f in (gate_up, down))
        ordered = tuple(sorted(formats, key=lambda f: (f not in FORMATS, f)))  # packed first: "q4_0/f32"
        table = table_bytes(cfg, element) if table_stays_in_host(cfg) else 0
        other = self.other_params * element + self.float32_params * 4
        if self.packed and packed_linear.wanted(device_type):
            other -= sum(packed_savings(self.packed, element).values())
        return MemoryEstimate(expert_bytes, other, ordered, dtype_name, table_bytes=table)


def summarize(config: dict, tensors: Mapping[str, TensorInfo], path="config.json") -> ModelWeights:
    """Sort a checkpoint's tensors (Hub names) as `engine.load.loader.load_model` does, checked as it checks
    them first: the config against the shapes, and no tensor the architecture does not know (one-line
    CheckpointError / UnsupportedModelError naming `path`)."""
    from moedesk.engine.load.compressed_tensors import shown_headers
    from moedesk.engine.load.fp8_blocks import without_scales

    tensors = without_scales(config, tensors, path)  # weights are sized as dequantised, by the loader's rules
    shown = shown_headers(config, {n: (t.stored, t.shape) for n, t in tensors.items()}, path)
    tensors = {n: TensorInfo(tuple(shape), stored) for n, (stored, shape) in shown.items()}
    if config.get("model_type") in TEXT_MODELS or text_config(config).get("model_type") == "qwen3_next":
        from moedesk.engine.load.delta_projections import shapes_as_read  # as the loader is shown them

        shown = shapes_as_read(config, {name: t.shape for name, t in tensors.items()})
        tensors = {name: dataclasses.replace(tensors[source], shape=shape) for name, (shape, source) in shown.items()}
    from moedesk.engine.load.fused_experts import fused_layout, shapes_apart

    if (layout := fused_layout(config)) is not None:  # fused experts, shown apart as engine.load.fused_experts does
        apart = shapes_apart({n: t.shape for n, t in tensors.items()}, layout)
        tensors = {name: TensorInfo(shape, "mxfp4" if packed else tensors[source].stored)
                   for name, (shape, packed, source) in apart.items()}
    cfg = parse_config(config, path, tensors={name: t.shape for name, t in tensors.items()})
    rules = weight_name_map(cfg)
    other, float32, experts, stored, packed = 0, 0, {}, {}, {}
    for name, info in tensors.items():
        if is_ignored_tensor(name, cfg):
            continue
        ours = map_weight_name(rules, name)
        if ours is None:
            raise UnsupportedModelError(path, f"unexpected tensor {name} for a {cfg.arch} model")
        if routed := ROUTED_EXPERT.fullmatch(ours):
            layer, e, proj = routed.groups()
            experts[int(layer), int(e), proj] = name
            stored[name] = info.stored
        elif parameter_dtype(cfg, ours, torch.bfloat16) == torch.float32:
            float32 += math.prod(info.shape)
        elif not (ours == "lm_head.weight" and cfg.tie_word_embeddings):  # the loader shares the embedding
            other += math.prod(info.shape)
            if _kept_packed(cfg.arch, ours, info):
                packed[ours] = (info.stored, *info.shape)
    return ModelWeights(cfg, other, experts, stored, float32, packed=packed)


# Qwen3.5-MoE's linear-attention output projection: its GGUF columns are regrouped by value head, which only its
# floats can undo (engine.load.gguf_checkpoint's packed_rows_format keeps it unpacked)
_REGROUPED = re.compile(r"layers\.\d+\.attn\.out\.weight")


def _kept_packed(arch: str, ours: str, info: TensorInfo) -> bool:
    """Whether a load that keeps packed weights keeps this non-expert tensor (our name) packed: the loader's rule
    (engine.load.loader.packed_plan) from the header alone."""
    return (len(info.shape) == 2 and packed_linear.keeps(ours, info.stored, info.shape[1])
            and not (arch == "qwen3_5_moe" and _REGROUPED.fullmatch(ours)))


def estimate_memory(config: dict, tensors: Mapping[str, TensorInfo], expert_dtype: str = "auto",
                    weights_dtype: str = "bfloat16", gpu: bool = False) -> MemoryEstimate:
    """RAM for the experts and for the rest of a model loaded with these dtypes, from its config.json dict and
    its tensor list alone (see `summarize` and `ModelWeights.estimate`)."""
    return summarize(config, tensors).estimate(expert_dtype, weights_dtype, gpu)


# --- tensor lists from headers ------------------------------------------------------------------------

def safetensors_header_tensors(header: Mapping) -> dict[str, TensorInfo]:
    """A safetensors header ({name: {dtype, shape, data_offsets}}, `__metadata__` aside) as TensorInfos."""
    return {name: TensorInfo(tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))
            for name, entry in header.items() if name != "__metadata__"}


def read_safetensors_header(file: Path) -> dict:
    """The JSON header of one .safetensors file (8 bytes of length, then the JSON): a few reads, not the weights."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(file, "truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:  # the format's own limit
            raise CheckpointError(file, f"safetensors header of {length} bytes: not a safetensors file")
        data = f.read(length)
    try:
        header = json_read.loads(data)
    except ValueError:
        raise CheckpointError(file, "truncated or corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(file, "corrupt safetensors header")
    return header


def folder_tensors(folder) -> dict[str, TensorInfo]:
    """Every tensor of a Hugging Face model folder, from its safetensors headers (the shards the index names,
    or every *.safetensors as the loader takes them)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / f for f in json_read.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(index, "unreadable shard index") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(folder, "no *.safetensors files")
    tensors = {}
    for file in files:
        tensors.update(safetensors_header_tensors(read_safetensors_header(file)))
    return tensors


def gguf_tensors(checkpoint) -> dict[str, TensorInfo]:
    """Every tensor of an opened `GGUFCheckpoint`, under the Hub's names (experts one by one), from its header."""
    return {name: TensorInfo(shape, checkpoint.packed_format(name) or stored_as(checkpoint, name) or "float")
            for name, shape in checkpoint.shapes().items()}


# --- GGUFs llama.cpp runs --------------------------------------------------------------------------------

# A layer's routed experts as llama.cpp stacks them (the tensors its --n-cpu-moe keeps in RAM), biases included.
_LLAMACPP_EXPERTS = re.compile(r"blk\.\d+\.ffn_(?:gate_up|gate|up|down)_exps\.")


@dataclass(frozen=True)
class FileWeights:
    """A GGUF whose architecture only llama.cpp runs: loaded, its tensors take what the file stores, in the
    file's own formats, whatever expert and weights dtype are chosen (those are the native engine's choices)."""

    arch: str  # general.architecture
    expert_bytes: int
    other_bytes: int
    expert_formats: tuple[str, ...]  # ggml type names: "mxfp4", "q4_k/q6_k", "f16"
    other_formats: str
    # engine.llamacpp.fit.GGUFShape: what llama.cpp's placement needs of the header, to plan its load
    llama_shape: object = field(default=None, compare=False, repr=False)

    def estimate(self, expert_dtype: str = "auto", weights_dtype: str = "bfloat16", gpu: bool = False) -> MemoryEstimate:
        if expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert dtype {expert_dtype!r}: choose one of {', '.join(EXPERT_DTYPES)}")
        return MemoryEstimate(self.expert_bytes, self.other_bytes, self.expert_formats, self.other_formats)


def file_weights(arch: str, tensors) -> FileWeights:
    """FileWeights from a GGUF's tensor infos (GGUFReader's or engine.load.gguf_header's: name, tensor_type,
    n_bytes)."""
    from gguf import GGMLQuantizationType

    sizes = {True: 0, False: 0}
    formats: dict[bool, set[str]] = {True: set(), False: set()}
    for t in tensors:
        routed = _LLAMACPP_EXPERTS.match(t.name) is not None
        sizes[routed] += int(t.n_bytes)
        if not (routed and t.name.endswith(".bias")):  # the experts' form is their matrices' (gpt-oss: mxfp4)
            formats[routed].add(GGMLQuantizationType(int(t.tensor_type)).name.lower())
    return FileWeights(arch, sizes[True], sizes[False], tuple(sorted(formats[True])), "/".join(sorted(formats[False])))


def _gguf_weights(path, header=None) -> ModelWeights | FileWeights:
    """How the engine `auto` picks will hold a GGUF: sorted as the native loader sorts it where the native engine
    runs its architecture, else as llama.cpp keeps it. `header`: a parsed header standing in for the file."""
    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES, GGUFCheckpoint

    try:
        checkpoint = GGUFCheckpoint(path, header=header)
    except UnsupportedModelError:
        # Read again for the architecture: only files the native engine refuses pay for it.
        if header is None:
            from gguf import GGUFReader

            from moedesk.engine.load.gguf_split import open_gguf

            header = open_gguf(Path(path), GGUFReader)  # a split GGUF's tensors from all its parts
        field = header.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        if not isinstance(arch, str) or arch in NATIVE_ARCHITECTURES:
            raise
        from moedesk.engine.llamacpp.fit import gguf_shape

        return dataclasses.replace(file_weights(arch, header.tensors), llama_shape=gguf_shape(header))
    try:
        from moedesk.engine.llamacpp.fit import gguf_shape

        return dataclasses.replace(summarize(checkpoint.config, gguf_tensors(checkpoint), path), arch=checkpoint.arch,
                                   llama_shape=gguf_shape(checkpoint.header))
    finally:
        checkpoint.close()


def summarize_gguf_header(parts, path, names: list | None = None) -> ModelWeights | FileWeights:
    """`summarize` for a GGUF file from its header alone (`engine.load.gguf_header.GGUFHeader`, parsed from bytes
    fetched without the tensor data), exactly as `summarize_path` does for the file on disk: the config
    GGUFCheckpoint derives from the metadata, the tensors under the Hub's names. `parts`: the one header, or
    a split GGUF's (-00001-of-0000N) in order. `path` names the file in messages, `names` each part (default:
    `path`)."""
    from moedesk.engine.load.gguf_header import GGUFHeader, merge_parts

    parts = [parts] if isinstance(parts, GGUFHeader) else list(parts)
    return _gguf_weights(path, merge_parts(parts, path, names))


def summarize_path(path) -> ModelWeights | FileWeights:
    """`summarize` for a model folder or a .gguf file on disk, from config.json and the headers alone (a GGUF only
    llama.cpp runs: its FileWeights)."""
    path = Path(path)
    if path.is_dir() and not any(path.glob("*.safetensors")):  # a folder (a Hub snapshot) of one GGUF, split or not
        from moedesk.engine.load.gguf_split import gguf_in_folder

        path = gguf_in_folder(path, recursive=True) or path
    if path.suffix == ".gguf":
        return _gguf_weights(path)
    config_path = path / "config.json"
    try:
        config = json_read.loads(config_path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(config_path, "missing or unreadable config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(config_path, "expected a JSON object")
    return summarize(config, folder_tensors(path), config_path)
