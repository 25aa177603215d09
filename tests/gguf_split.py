"""A GGUF file written again in parts, as llama.cpp's `llama-gguf-split --split` lays them out: gguf's own writer with
its split options (what convert_hf_to_gguf.py --split-max-tensors runs), fed the file's metadata and tensor bytes
as they are. llama-cpp-python loading the parts (tests/llamacpp/test_split_gguf.py) shows they are a real split."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np


def split_gguf(single: Path, out: Path, parts: int, first_empty: bool = False) -> list[Path]:
    """`single` rewritten as `parts` files out-00001-of-0000N.gguf ... (out's stem, out's folder); first_empty: the
    first part holds the metadata alone (gguf-split --no-tensor-first-split). Returns the parts, the first first."""
    reader = gguf.GGUFReader(single)
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    holding = parts - 1 if first_empty else parts
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=math.ceil(len(reader.tensors) / holding),
                             small_first_shard=first_empty)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data = np.array(tensor.data)  # typed as the reader hands it out: quantised blocks and BF16 as bytes
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    assert [p.name for p in written] == [f"{out.stem}-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)], written
    return written
