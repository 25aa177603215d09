"""Checkpoints quantised in the compressed-tensors format (llm-compressor's), shown as float ones or as q4_0 blocks:
Kimi-K2-Thinking's and Kimi-K2.5's INT4 experts, the GLM-4.x and other FP8 releases made with it.

Their config says `quantization_config: {quant_method: "compressed-tensors", format, config_groups, ignore}`. Each
group applies one weight scheme to the modules its `targets` name (a module name, "re:" and a regex matched from the
name's start, or the class "Linear"), except those `ignore` names alike; a group may carry its own `format`. Two
formats are read here, symmetric and without zero points:
- pack-quantized (integers): module M has `M.weight_packed` int32 [rows, ceil(cols / (32 / bits))], value i of a row
  in bits [bits * (i % n), bits * (i % n + 1)) of word i // n (n = 32 / bits) as q + 2^(bits - 1);
  `M.weight_shape` [rows, cols]; `M.weight_scale` [rows, ceil(cols / group)] (strategy group) or [rows, 1] (channel).
  w = q * scale.
- float-quantized (FP8): `M.weight` float8_e4m3fn, `M.weight_scale` per tensor ([1]), per output channel ([rows, 1]),
  per group of columns ([rows, ceil(cols / group)]) or per block ([ceil(rows / B0), ceil(cols / B1)]). w = fp8 * scale.
The product is exact in float32 for 16-bit scales; it is rounded once to the dtype asked for.

A 4-bit weight in groups of 32 whose rows are whole groups is already q4_0, GGUF's 32-weight block of nibbles
(q + 8, as stored) beside a float16 scale: `CompressedTensors.read_packed` rearranges the nibbles and writes the
scale as float16, never going through float. That conversion is exact for every bf16 scale from 2^-17 to 65504 (a
bf16 has 8 significant bits, a float16 has 11 down to 2^-14 and fewer below); a smaller scale is rounded to the
nearest float16, off by at most 2^-25 (its weights are below 2^-14), and a larger one, which no weights in floats
have, is refused. Activation quantisation computed at run time (`dynamic`) is a rounding of the kernels that compute
in 8 bits, not of the model, and is dropped as transformers' dequantising load drops it; anything else that changes
the numbers (zero points, static activation scales, activation-ordered groups, sparse formats, transforms, a
quantised KV cache, another format) is refused in one line naming it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moedesk.engine.errors import CheckpointError, UnsupportedModelError

METHOD = "compressed-tensors"
_FORMATS = ("pack-quantized", "float-quantized")
# What each quantised module M keeps beside (or instead of) M.weight
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
_REFUSED_TENSORS = {"weight_zero_point": "zero points (asymmetric quantisation)",
                    "weight_g_idx": "activation-ordered groups (weight_g_idx)",
                    "input_scale": "static activation scales (input_scale)",
                    "weight_global_scale": "two-level scales (weight_global_scale)"}
_CHUNK = 1 << 18  # weights dequantised at once: temporaries stay a few MiB whatever the tensor's size


@dataclass(frozen=True)
class Scheme:
    """How one group's weights are stored: integers packed in int32 words, or fp8; scales per block of
    (b0 rows, b1 columns) where b0 or b1 may be None for "all of them" (a tensor's, a channel's)."""

    kind: str  # "int" | "float"
    bits: int
    block: tuple[int | None, int | None]

    def blocks(self, rows: int, cols: int) -> tuple[int, int]:
        return self.block[0] or rows, self.block[1] or cols


@dataclass(frozen=True)
class Plan:
    """A checkpoint's quantization_config, checked: each target's scheme (a target named by two groups takes the
    later's, as compressed-tensors maps them) and the modules it ignores."""

    targets: tuple[tuple[str, Scheme], ...]
    ignore: tuple[str, ...]

    def scheme_of(self, module: str) -> Scheme | None:
        """The scheme the config gives `module`; None where it leaves it unquantised. Where several targets match,
        compressed-tensors' order decides: exact names, then regexes in sorted order, then the class Linear."""
        if any(_named(module, target) or target == "Linear" for target in self.ignore):
            return None
        ordered = sorted(self.targets, key=lambda ts: (ts[0].startswith("re:"), ts[0]))
        by_name = (scheme for target, scheme in ordered if _named(module, target))
        return next(by_name, dict(self.targets).get("Linear"))


def _named(module: str, target: str) -> bool:
    """compressed-tensors' name match: a regex from the name's start, or the whole name."""
    return re.match(target[3:], module) is not None if target.startswith("re:") else target == module


def plan(config: dict, path) -> Plan | None:
    """The Plan of a compressed-tensors checkpoint's config; None when its quantization_config is another method's
    (or absent). One-line UnsupportedModelError naming what this module does not load."""
    from moedesk.engine.load.fp8_blocks import quantization_config

    q = quantization_config(config)
    if not isinstance(q, dict) or q.get("quant_method") != METHOD:
        return None

    def refuse(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(path, f"weights quantised with {METHOD!r} with {what} (its quantization_config), "
                                           f"which moedesk does not load: use the model's unquantised safetensors or "
                                           f"a GGUF of it")

    if q.get("quantization_status", "compressed") not in (None, "compressed"):
        raise refuse(f"quantization_status {q['quantization_status']!r} (only 'compressed' weights are read)")
    sparsity = q.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") not in (None, "dense"):
        raise refuse(f"the sparse format {sparsity.get('format') if isinstance(sparsity, dict) else sparsity!r}")
    if q.get("transform_config"):
        raise refuse("transforms applied to the weights (transform_config)")
    if q.get("kv_cache_scheme"):
        raise refuse("a quantised KV cache (kv_cache_scheme)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("no config_groups")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise refuse(f"ignore {ignore!r} (a list of module names expected)")
    planned = {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"config group {name!r} that is not an object")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise refuse(f"config group {name!r} without a list of targets")
        for target in targets:  # a class name other than Linear: which tensors it covers is the model code's
            if not target.startswith("re:") and target[:1].isupper() and target != "Linear":
                raise refuse(f"the target {target!r} (a module class moedesk does not map to tensors)")
        scheme = _scheme(group, group.get("format") or q.get("format"), name, refuse)
        planned.update({target: scheme for target in targets})
    return Plan(tuple(planned.items()), tuple(ignore))


def _scheme(group: dict, fmt, name: str, refuse) -> Scheme:
    if fmt not in _FORMATS:
        raise refuse(f"the format {fmt!r}")
    if group.get("output_activations"):
        raise refuse(f"output activations quantised (config group {name!r})")
    inputs = group.get("input_activations")
    if inputs and not (isinstance(inputs, dict) and inputs.get("dynamic") is True):
        raise refuse(f"static activation scales (config group {name!r}'s input_activations)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise refuse(f"config group {name!r} without weights")
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits", 8), w.get("strategy")
    if w.get("symmetric", True) is not True:
        raise refuse("asymmetric weights (zero points)")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise refuse(f"activation-ordered groups (actorder {w.get('actorder')!r})")
    if w.get("dynamic") not in (None, False):
        raise refuse("weights quantised at run time (dynamic weights)")
    size = w.get("group_size")
    if strategy is None:  # as compressed-tensors infers it
        strategy = "tensor" if size is None else "channel" if size == -1 else "group"
    if (kind, fmt) == ("int", "pack-quantized") and bits in (4, 8):
        allowed = ("group", "channel")
    elif (kind, fmt, bits) == ("float", "float-quantized", 8):
        allowed = ("tensor", "channel", "group", "block")
    else:
        raise refuse(f"{bits}-bit {kind} weights in the format {fmt!r}")
    if strategy not in allowed:
        raise refuse(f"{bits}-bit {kind} weights scaled per {strategy!r}")
    if strategy == "group":
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise refuse(f"group_size {size!r} (a positive whole number expected)")
        return Scheme(kind, bits, (1, size))
    if strategy == "block":
        b = w.get("block_structure")
        if (not isinstance(b, list) or len(b) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)):
            raise refuse(f"block_structure {b!r} (two positive whole numbers expected)")
        return Scheme(kind, bits, (b[0], b[1]))
    return Scheme(kind, bits, (1, None) if strategy == "channel" else (None, None))


# --- what the loader is shown ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """One quantised weight as the checkpoint holds it."""

    scheme: Scheme
    shape: tuple[int, int]  # the weight's, as dequantised
    values: str  # the tensor of the numbers: M.weight_packed or M.weight
    scale: str

    @property
    def packed_as(self) -> str | None:
        """"q4_0" where the bytes are q4_0's but for their order (4 bits in groups of 32, rows of whole groups)."""
        return "q4_0" if (self.scheme.kind, self.scheme.bits, self.scheme.block) == ("int", 4, (1, 32)) \
            and self.shape[1] % 32 == 0 else None

    @property
    def label(self) -> str:
        """What the size estimate records as its stored form (engine.load.size_estimate.TensorInfo.stored)."""
        return self.packed_as or ("F8_E4M3" if self.scheme.kind == "float" else f"int{self.scheme.bits}")


def stored_weights(plan_: Plan, headers: dict, path) -> dict[str, Stored]:
    """{shown weight name: Stored} of a checkpoint's quantised weights, from its headers ({name: (dtype, shape)});
    one-line errors where the tensors disagree with the config or with each other. A packed weight's column count
    is its words' (a multiple of 32 / bits): engine.load's readers check it against M.weight_shape."""
    out = {}
    for name in headers:
        module, _, leaf = name.rpartition(".")
        if leaf in _REFUSED_TENSORS:
            raise UnsupportedModelError(path, f"weights quantised with {METHOD!r} with "
                                              f"{_REFUSED_TENSORS[leaf]}, which moedesk does not load: use the "
                                              f"model's unquantised safetensors or a GGUF of it")
        scale = f"{module}.{SCALE}"
        if leaf == SCALE and f"{module}.{PACKED}" not in headers and f"{module}.weight" not in headers:
            raise CheckpointError(path, f"{name} scales no tensor: there is neither {module}.weight nor "
                                        f"{module}.{PACKED}")
        packed = leaf == PACKED
        if leaf == "weight" and headers[name][0].startswith("F8_") and scale not in headers:
            raise CheckpointError(path, f"tensor {name} holds {headers[name][0]} values without its {scale}")
        if not (packed or leaf == "weight" and scale in headers and f"{module}.{PACKED}" not in headers):
            continue
        values = name
        scheme = plan_.scheme_of(module)
        kind = "int" if packed else "float"
        if scheme is None or scheme.kind != kind:
            given = "no scheme (its ignore and targets)" if scheme is None else f"{scheme.kind} weights"
            raise CheckpointError(path, f"tensor {values} is {'packed integers' if packed else 'scaled'}, but the "
                                        f"quantization_config gives {module} {given}")
        if scale not in headers:
            raise CheckpointError(path, f"tensor {values} has no {scale} beside it")
        vdtype, vshape = headers[values]
        if packed:
            if vdtype != "I32" or len(vshape) != 2:
                raise CheckpointError(path, f"tensor {values} holds {vdtype} {list(vshape)}, not int32 words [rows, "
                                            f"columns / {32 // scheme.bits}]")
            if f"{module}.{SHAPE}" not in headers:
                raise CheckpointError(path, f"tensor {values} has no {module}.{SHAPE} beside it")
            rows, cols = vshape[0], vshape[1] * (32 // scheme.bits)
        else:
            if vdtype != "F8_E4M3" or len(vshape) != 2:
                raise CheckpointError(path, f"tensor {values} holds {vdtype} {list(vshape)}, not float8_e4m3fn "
                                            f"weights [rows, columns] beside its {module}.{SCALE}")
            rows, cols = vshape
        b0, b1 = scheme.blocks(rows, cols)
        wanted, found = (math.ceil(rows / b0), math.ceil(cols / b1)), tuple(headers[scale][1])
        if math.prod(found) != math.prod(wanted) or len(found) > 2 or (len(found) == 2 and found != wanted):
            raise CheckpointError(path, f"tensor {scale} has shape {list(found)}: {values} [{rows}, "
                                        f"{cols}] in blocks of {b0}x{b1} implies {list(wanted)}")
        out[f"{module}.weight"] = Stored(scheme, (rows, cols), values, scale)
    return out


def shown_headers(config: dict, headers: dict, path) -> dict:
    """A checkpoint's {name: (dtype, shape)} as `CompressedTensors` shows it (each quantised weight as M.weight of its
    dequantised shape and its stored label, the scales and shapes hidden); any other checkpoint's as it is."""
    plan_ = plan(config, path)
    return headers if plan_ is None else _shown(headers, stored_weights(plan_, headers, path))


def _shown(headers: dict, stored: dict[str, Stored]) -> dict:
    hidden = {s.scale for s in stored.values()} | {s.values for s in stored.values()} \
        | {n.removesuffix("weight") + SHAPE for n in stored}
    shown = {n: h for n, h in headers.items() if n not in hidden}
    shown.update({n: (s.label, s.shape) for n, s in stored.items()})
    return shown


# --- the arithmetic -----------------------------------------------------------------------------------------------

def unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Integers [rows, cols] (uint8, as stored: q + 2^(bits - 1)) from int32 words [rows, ceil(cols * bits / 32)]."""
    raw = words.contiguous().view(torch.uint8)  # little-endian: value i of a word is in its byte i * bits // 8
    if bits == 8:
        return raw[:, :cols]
    return torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)[:, :cols]


def dequantize(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               offset: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Weights [rows, cols] in `dtype`: each value (minus `offset`: 2^(bits - 1) for stored integers) times its
    (b0 x b1) block's scale in float32, rounded once. A few rows at a time, so no float32 copy of the weight exists."""
    rows, cols = values.shape
    b0, b1 = block
    factors = scale.reshape(math.ceil(rows / b0), math.ceil(cols / b1)).to(device=values.device, dtype=torch.float32)
    along = torch.arange(cols, device=values.device) // b1
    out = torch.empty((rows, cols), dtype=dtype, device=values.device) if out is None else out
    step = rows if values.device.type != "cpu" else max(1, _CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        part = values[start:start + step]
        part = part.to(torch.int16) - offset if offset else part
        f = factors[torch.arange(start, start + part.shape[0], device=values.device) // b0][:, along]
        out[start:start + step].copy_(part.to(dtype)).mul_(f)
    return out


def fp16_scales(scale: torch.Tensor, path, name: str) -> torch.Tensor:
    """A q4_0 block's float16 scales from the checkpoint's (bf16 exact from 2^-17 up; see the module's docstring);
    CheckpointError where one exceeds float16's range."""
    half = scale.to(torch.float16)
    if not torch.isfinite(half).all() and torch.isfinite(scale).all():
        big = scale.float().abs().max().item()
        raise CheckpointError(path, f"tensor {name} has a scale of {big:g}, beyond float16's 65504: load it with "
                                    f"--expert-dtype int8 or bf16")
    return half


def q4_0_rows(words: torch.Tensor, scale: torch.Tensor, cols: int, path="", name: str = "") -> torch.Tensor:
    """q4_0 rows [rows, cols / 32 * 18] (engine.kernels.quant_formats) of a 4-bit, group-32 packed weight: the same
    nibbles, regrouped (byte j of a block: weight j low, weight j + 16 high), after each group's float16 scale."""
    rows = words.shape[0]
    u = unpack(words, 4, cols).reshape(rows, cols // 32, 32)
    nibbles = u[..., :16] | (u[..., 16:] << 4)
    d = fp16_scales(scale.reshape(rows, cols // 32), path, name).view(torch.uint8).reshape(rows, cols // 32, 2)
    return torch.cat([d, nibbles], dim=-1).reshape(rows, cols // 32 * 18)


# --- the checkpoint -----------------------------------------------------------------------------------------------

class CompressedTensors:
    """A SafetensorsCheckpoint of a compressed-tensors release: each quantised weight shown as M.weight, dequantised
    as read (or its q4_0 rows, for the loader to keep packed), its scales and shapes hidden (see the module's
    docstring)."""

    def __init__(self, inner, plan_: Plan):
        self.inner = inner
        self.dtype, self.device = torch.float32, torch.device("cpu")
        headers = {n: (inner.tensor_dtype(n), tuple(inner.get_tensor_shape(n))) for n in inner.keys()}
        self._stored = stored_weights(plan_, headers, inner.path)
        self._keys = list(_shown(headers, self._stored))

    def __getattr__(self, name):  # path, config, tokenizer, tokenizer_config, close, concurrent_reads...
        return getattr(self.inner, name)

    def keys(self) -> list[str]:
        return list(self._keys)

    def shapes(self):
        return None  # parse_config reads the files' headers, whose M.weight names only plain weights keep

    def dequantise_in(self, dtype: torch.dtype, device="cpu") -> None:
        """Weights read from now on come in `dtype`, computed on `device` (as engine.load.fp8_blocks.FP8Blocks)."""
        self.dtype, self.device = dtype, torch.device(device)

    def stored_fp8(self, name: str) -> bool:
        return name in self._stored and self._stored[name].scheme.kind == "float"

    def released_as(self, name: str) -> str | None:
        """What `--expert-dtype auto` quantises this weight to where it is not kept packed: the bytes a weight the
        release has (fp8 and 8-bit integers: int8; 4-bit integers: int4)."""
        s = self._stored.get(name)
        return None if s is None else "int4" if s.scheme.bits == 4 else "int8"

    def packed_format(self, name: str) -> str | None:
        s = self._stored.get(name)
        return s.packed_as if s is not None else self.inner.packed_format(name)

    def _columns(self, name: str, s: Stored) -> int:
        """The weight's columns from M.weight_shape, which must agree with the words' count."""
        shape = tuple(int(v) for v in self.inner.get_tensor(s.values.removesuffix(PACKED) + SHAPE).tolist())
        per_word = 32 // s.scheme.bits
        if len(shape) != 2 or shape[0] != s.shape[0] or math.ceil(shape[1] / per_word) * per_word != s.shape[1]:
            raise CheckpointError(self.inner.path, f"tensor {s.values.removesuffix(PACKED) + SHAPE} says {list(shape)}"
                                                   f", but {s.values} holds {s.shape[0]} rows of "
                                                   f"{s.shape[1] // per_word} words")
        if shape[1] != s.shape[1]:
            raise CheckpointError(self.inner.path, f"tensor {name} has {shape[1]} columns, not a multiple of "
                                                   f"{per_word}: moedesk reads packed rows of whole words only")
        return shape[1]

    def read_packed(self, name: str, out: torch.Tensor) -> None:
        """The q4_0 rows of a weight `packed_format` calls q4_0 into the uint8 tensor `out`."""
        s = self._stored.get(name)
        if s is None or s.packed_as is None:
            return self.inner.read_packed(name, out)
        cols = self._columns(name, s)
        words, scale = self.inner.get_tensor(s.values), self.inner.get_tensor(s.scale)
        if out.dtype != torch.uint8 or tuple(out.shape) != (s.shape[0], cols // 32 * 18):
            raise CheckpointError(self.inner.path, f"{name} holds q4_0 rows of shape "
                                                   f"({s.shape[0]}, {cols // 32 * 18}), not {tuple(out.shape)}")
        step = max(1, _CHUNK // cols)
        for start in range(0, s.shape[0], step):
            out[start:start + step].copy_(q4_0_rows(words[start:start + step], scale[start:start + step], cols,
                                                    self.inner.path, s.scale))

    def get_tensor(self, name: str, index: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """As SafetensorsCheckpoint.get_tensor; a quantised weight dequantised, in float32 unless dequantise_in said
        otherwise."""
        s = self._stored.get(name)
        if s is None:
            return self.inner.get_tensor(name, index, part)
        scale = self.inner.get_tensor(s.scale).to(self.device)
        rows, cols = s.shape
        if s.scheme.kind == "int":
            cols = self._columns(name, s)
            values = unpack(self.inner.get_tensor(s.values).to(self.device), s.scheme.bits, cols)
            offset = 1 << (s.scheme.bits - 1)
        else:
            values, offset = self.inner.get_tensor(s.values).to(self.device), 0
        out = dequantize(values, scale, s.scheme.blocks(rows, cols), self.dtype, offset)
        del values
        if index is not None:
            out = out[index]
        return out if part is None else out.chunk(part[1])[part[0]].contiguous()

    def release(self, name: str) -> None:
        s = self._stored.get(name)
        if s is None:
            return self.inner.release(name)
        shape = (s.values.removesuffix(PACKED) + SHAPE,) if s.scheme.kind == "int" else ()
        for hidden in (s.values, s.scale, *shape):
            self.inner.release(hidden)
