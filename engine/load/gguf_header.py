"""A GGUF file's header (magic, version, key/value metadata, tensor infos) parsed from its first bytes alone.

The download wizard reads a GGUF's header from the Hub with Range requests, without the tensor data, to estimate
the memory the model takes once loaded. The gguf package's GGUFReader cannot parse a prefix of a file: it
memory-maps a whole file and makes a view of every tensor's data. `parse_header(data, path)` reads only the
header's structure, and raises `HeaderIncomplete` when `data` ends before the header does, so the caller can
fetch more bytes and try again.

A `GGUFHeader` stands in for a GGUFReader where `engine.load.gguf_checkpoint.GGUFCheckpoint` reads one: its
`fields` answer `contents()` and `types` as the reader's do, its `tensors` carry name, shape (GGUF order, fastest
dimension first), type and data offset. Their `data` is None: nothing of it was read.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from moedesk.engine.errors import CheckpointError

SUPPORTED_VERSIONS = (2, 3)  # what GGUFReader reads (version 1 had 32-bit counts and lengths)
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor with more

_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# Tensor types whose data GGUFReader hands out typed; the others (quantised blocks, BF16) as bytes.
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class HeaderIncomplete(Exception):
    """The bytes given end inside the header: at least `needed` bytes of the file are needed to parse it."""

    def __init__(self, needed: int):
        super().__init__(f"the GGUF header needs at least {needed} bytes")
        self.needed = needed


@dataclass(frozen=True)
class HeaderField:
    """One key/value pair, answering as gguf's ReaderField does."""

    name: str
    value: object  # str, int, float, bool, or a list of them
    types: list[GGUFValueType]  # [UINT32], [STRING], [ARRAY, STRING]...: ReaderField.types

    def contents(self):
        return self.value


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest dimension first, as GGUFReader's
    tensor_type: GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray | None = None  # not read (see with_data)
    endian: str = "<"

    def with_data(self, raw: bytes) -> HeaderTensor:
        """This tensor with its `n_bytes` of data, as GGUFReader would view them (for the rare tensor whose values
        a config depends on, fetched on its own)."""
        if len(raw) != self.n_bytes:
            raise ValueError(f"{self.name} holds {self.n_bytes} bytes, not {len(raw)}")
        shape = tuple(reversed(self.shape))
        if self.tensor_type in _TYPED:
            data = np.frombuffer(raw, dtype=np.dtype(_TYPED[self.tensor_type]).newbyteorder(self.endian))
        else:
            data = np.frombuffer(raw, dtype=np.uint8)
            shape = quant_shape_to_byte_shape(shape, self.tensor_type)
        return replace(self, data=data.reshape(shape))


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, HeaderField]
    tensors: list[HeaderTensor]
    alignment: int
    data_offset: int  # where the tensor data starts: the header's end, aligned
    header_bytes: int  # the bytes parsed (the header without the padding after it)


def parse_header(data: bytes, path) -> GGUFHeader:
    """The header at the start of `data` (a whole GGUF file, or any prefix of one). Raises HeaderIncomplete when
    `data` ends inside the header, CheckpointError (one line naming `path`) when it is not a GGUF header."""
    return _Parser(memoryview(data), path).header()


def merge_parts(parts: list[GGUFHeader], path, names: list | None = None) -> GGUFHeader:
    """One header for a split GGUF (`-00001-of-0000N`), its parts' headers given in order: llama.cpp's gguf-split
    writes the metadata into the first part and spreads the tensors over all of them (engine.load.gguf_split, which
    checks them). Each tensor's data_offset stays that of its own part. `names`: the parts' names in messages
    (default: `path` for each)."""
    from moedesk.engine.load.gguf_split import join

    if len(parts) == 1 and "split.count" not in parts[0].fields:
        return parts[0]
    return replace(parts[0], tensors=join(parts, names or [path] * len(parts)).tensors)


class _Parser:
    def __init__(self, data: memoryview, path):
        self.data, self.path, self.pos, self.endian = data, path, 0, "<"

    def corrupt(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, f"corrupt GGUF header ({problem})")

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise HeaderIncomplete(end)
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(self.endian + fmt, self.take(size))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8") from None

    def value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.corrupt(f"unknown value type {raw} for {key!r}") from None

    def value(self, kind: GGUFValueType, key: str) -> tuple[object, list[GGUFValueType]]:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind]), [kind]
        if kind == GGUFValueType.STRING:
            return self.string(f"the value of {key!r}"), [kind]
        # An array: its items' type, their count, the items.
        item = self.value_type(self.scalar("I"), key)
        count = self.scalar("Q")
        if item in _SCALARS:  # numbers in one go: vocabularies hold hundreds of thousands of scores
            dtype = np.dtype(self.endian + _SCALARS[item])
            items = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return items, [kind, item]
        items, types = [], [kind, item]
        for _ in range(count):
            value, item_types = self.value(item, key)
            items.append(value)
            types = [kind, *item_types]
        return items, types

    def header(self) -> GGUFHeader:
        if bytes(self.data[:4]) != b"GGUF":
            if len(self.data) < 4 and b"GGUF".startswith(bytes(self.data)):
                raise HeaderIncomplete(4)
            raise CheckpointError(self.path, "not a GGUF file (bad magic)")
        self.pos = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order (GGUFReader's test)
            self.endian = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointError(self.path, f"GGUF version {version} is not supported "
                                             f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        tensor_count, kv_count = self.scalar("Q"), self.scalar("Q")

        fields: dict[str, HeaderField] = {}
        for _ in range(kv_count):
            key = self.string("a metadata key")
            value, types = self.value(self.value_type(self.scalar("I"), key), key)
            if key in fields:
                raise self.corrupt(f"metadata key {key!r} twice")
            fields[key] = HeaderField(key, value, types)

        infos = []
        for _ in range(tensor_count):
            name = self.string("a tensor name")
            n_dims = self.scalar("I")
            if n_dims > MAX_DIMS:
                raise self.corrupt(f"tensor {name} has {n_dims} dimensions")
            shape = tuple(self.scalar("Q") for _ in range(n_dims))
            raw_type = self.scalar("I")
            try:
                tensor_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise self.corrupt(f"tensor {name} has unknown type {raw_type}") from None
            infos.append((name, shape, tensor_type, self.scalar("Q")))
        header_bytes = self.pos

        alignment = GGUF_DEFAULT_ALIGNMENT
        if (field := fields.get("general.alignment")) is not None:
            alignment = field.contents()
            if field.types != [GGUFValueType.UINT32] or alignment == 0 or alignment & (alignment - 1):
                raise self.corrupt(f"general.alignment {alignment!r} is not a power of two")
        data_offset = -(-header_bytes // alignment) * alignment
        tensors, names = [], set()
        for name, shape, tensor_type, offset in infos:
            if name in names:
                raise self.corrupt(f"tensor {name} twice")
            names.add(name)
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            n_bytes = math.prod(shape) * block_bytes // block  # as GGUFReader counts them
            tensors.append(HeaderTensor(name, shape, tensor_type, data_offset + offset, n_bytes, endian=self.endian))
        return GGUFHeader(version, fields, tensors, alignment, data_offset, header_bytes)
