"""A GGUF file written again in parts, as llama.cpp's `llama-gguf-split --split` lays them out: gguf's own writer with
its split options (what convert_hf_to_gguf.py --split-max-tensors runs), fed the file's metadata and tensor bytes
as they are. llama-cpp-python loading the parts (tests/llamacpp/test_split_gguf.py) shows they are a real split.

Usage: python -m tests.gguf_split IN.gguf OUT.gguf N [--first-empty]   (writes OUT-00001-of-0000N.gguf ...)"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import gguf


def split_gguf(single: Path, out: Path, parts: int, first_empty: bool = False) -> list[Path]:
    """`single` rewritten as `parts` files out-00001-of-0000N.gguf ... (out's stem, out's folder); first_empty: the
    first part holds the metadata alone (gguf-split --no-tensor-first-split). Returns the parts, the first first."""
    reader = gguf.GGUFReader(single)
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    holding = parts - 1 if first_empty else parts
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=math.ceil(len(reader.tensors) / holding),
                             small_first_shard=first_empty)
    _copy(reader, writer)
    written = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    expected = [f"{out.stem}-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
    assert [p.name for p in written] == expected, written
    return written


def with_metadata(single: Path, out: Path, **values: int) -> Path:
    """`single` written again as `out` with some integer metadata changed (key=value; "__" stands for "."), as a
    file converted with other settings would hold them: lfm2moe__context_length=8192."""
    reader = gguf.GGUFReader(single)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    _copy(reader, writer, {key.replace("__", "."): value for key, value in values.items()})
    return out


def _copy(reader, writer, changed: dict | None = None) -> None:
    """Every field and tensor of `reader` through `writer`, with the `changed` fields' values instead."""
    changed = changed or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, changed.pop(field.name, field.contents()), kind, sub_type=sub)
    assert not changed, f"no such fields: {sorted(changed)}"
    for tensor in reader.tensors:
        # The reader's memory-mapped view, typed as it hands it out (quantised blocks and BF16 as bytes): written
        # from the page cache, so a whole model splits without being held in memory.
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def parts_size(path: Path) -> int:
    """Bytes on disk of a GGUF: the file, or every part of the split one it is a part of."""
    from moedesk.engine.listing import gguf_parts

    return sum(p.stat().st_size for p in gguf_parts(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("single", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("parts", type=int)
    ap.add_argument("--first-empty", action="store_true", help="the metadata alone in the first part")
    args = ap.parse_args()
    for part in split_gguf(args.single, args.out, args.parts, args.first_empty):
        print(part)


if __name__ == "__main__":
    main()
