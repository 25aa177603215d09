"""A GGUF split by llama.cpp's gguf-split (or gguf-py's writer) into parts, read as the one model it is.

The convention: parts are named NAME-00001-of-0000N.gguf ... NAME-0000N-of-0000N.gguf; the first part holds all the
metadata, every part states `split.no` (0-based), `split.count` and `split.tensors.count` (the whole model's tensor
count), and the tensors are spread over the parts, each tensor's data offset counted in its own part. The first part
may hold no tensors at all (gguf-split --no-tensor-first-split). llama.cpp loads from the first part and finds the
others by name; so does this module, from any part's path, and checks the parts as llama.cpp does, each problem one
line naming the part.

`part_paths` and `join` are pure (names; parsed headers), `open_gguf` opens the files (memory-mapped, as a single
file is: nothing of the tensors is read).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moedesk.engine.errors import CheckpointError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


@dataclass(frozen=True)
class Joined:
    """The parts' headers as one: `fields` are the first part's (all the metadata), `tensors` every part's in order
    (GGUFReader's ReaderTensor or gguf_header's HeaderTensor), `part_of` says which part holds each tensor."""

    fields: dict
    tensors: list
    part_of: dict[str, int]  # tensor name -> index into `paths`
    paths: tuple  # the parts, the first first: Path on disk, or the names a Hub listing gives


def split_stem(path: Path) -> Path:
    """name-00001-of-00003.gguf -> name (in its folder): what the parts of one split GGUF share; other names as
    they are."""
    named = _PART_NAME.fullmatch(path.name)
    return path.with_name(named.group(1)) if named else path


def part_paths(path: Path) -> list[Path]:
    """Every part of the split GGUF that `path` is a part of, the first first, from its name alone; [path] for a
    name without llama.cpp's -NNNNN-of-NNNNN suffix."""
    named = _PART_NAME.fullmatch(path.name)
    if named is None:
        return [path]
    count = int(named.group(3))
    return [path.with_name(f"{named.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def check_present(parts: list[Path]) -> None:
    """A missing part is one line naming it (before anything reads the others)."""
    for i, part in enumerate(parts, 1):
        if not part.is_file():
            raise CheckpointError(part, f"missing: part {i} of the GGUF split in {len(parts)} files that "
                                        f"{parts[0].name} begins")


def gguf_in_folder(folder: Path, recursive: bool = False) -> Path | None:
    """The first part (or the only file) of the one GGUF model in `folder`; None when it holds none, or several
    (which one the user means is theirs to say). Vision projectors (mmproj-*.gguf) are not the model."""
    found = folder.rglob("*.gguf") if recursive else folder.glob("*.gguf")
    files = sorted(p for p in found if p.is_file() and not p.name.lower().startswith("mmproj"))
    if not files or len({split_stem(p) for p in files}) != 1:
        return None
    return part_paths(files[0])[0]


def _value(header, key: str):
    field = header.fields.get(key)
    return None if field is None else field.contents()


def join(headers: list, paths: list) -> Joined:
    """The parts' headers (GGUFReader or engine.load.gguf_header.GGUFHeader, in order) as one model; `paths` name
    them in messages. Checked as llama.cpp's loader checks them: each part's split.no its place, one split.count,
    one split.tensors.count that the parts' tensors add up to, no tensor twice. A part of another model breaks one
    of these, and is named."""
    first, name = headers[0], Path(str(paths[0])).name
    count, number = _value(first, SPLIT_COUNT), _value(first, SPLIT_NO)
    if len(headers) == 1 and (count is None or count <= 1):
        return Joined(first.fields, list(first.tensors), {t.name: 0 for t in first.tensors}, tuple(paths))
    if count is None:
        raise CheckpointError(paths[0], f"not a part of a split GGUF (no {SPLIT_COUNT}), though its name says "
                                        f"it is part 1 of {len(headers)}")
    if len(headers) == 1:  # split.count > 1 in a file whose name does not say where the other parts are
        raise CheckpointError(paths[0], f"part {(number or 0) + 1} of a GGUF split in {count} files, named without "
                                        f"llama.cpp's -NNNNN-of-{count:05d} suffix: its other parts cannot be found")
    if count != len(headers):
        raise CheckpointError(paths[0], f"part 1 of a GGUF split in {count} files, but {len(headers)} parts were "
                                        f"found")
    total = _value(first, SPLIT_TENSORS)
    tensors, part_of = [], {}
    for i, (header, path) in enumerate(zip(headers, paths)):
        no, of, in_all = _value(header, SPLIT_NO), _value(header, SPLIT_COUNT), _value(header, SPLIT_TENSORS)
        if (no, of, in_all) != (i, count, total):
            said = "no split keys" if no is None else f"part {no + 1} of {of}, of {in_all} tensors in all"
            raise CheckpointError(path, f"not part {i + 1} of the GGUF split that {name} begins (part 1 says "
                                        f"{count} parts, {total} tensors in all; this one says {said}): a part of "
                                        f"another model?")
        for tensor in header.tensors:
            if tensor.name in part_of:
                other = Path(str(paths[part_of[tensor.name]])).name
                raise CheckpointError(path, f"tensor {tensor.name} is also in {other}: a part of another model, or "
                                            f"of another split of it?")
            part_of[tensor.name] = i
            tensors.append(tensor)
    if len(tensors) != total:
        raise CheckpointError(paths[0], f"the GGUF split in {count} files that it begins holds {len(tensors)} "
                                        f"tensors, but says {total}")
    return Joined(first.fields, tensors, part_of, tuple(paths))


def open_gguf(path: Path, open_reader) -> Joined:
    """The GGUF at `path` (a single file, or any part of a split one) with every part opened by
    `open_reader(path)` (GGUFReader, or a wrapper that turns its errors into one line) and joined."""
    parts = part_paths(path)
    check_present(parts)
    return join([open_reader(p) for p in parts], parts)
