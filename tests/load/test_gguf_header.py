"""engine.load.gguf_header against the gguf package's own reader, on files its GGUFWriter wrote: the same fields,
values and tensor infos, from the header's bytes alone; any shorter prefix asks for more; bad files in one line."""
from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.load.gguf_header import HeaderIncomplete, merge_parts, parse_header
from moedesk.engine.load.size_estimate import summarize_gguf_header, summarize_path
from tests.load.test_gguf_checkpoint import spm_vocab

gguf = pytest.importorskip("gguf")

# Each layer's (gate/up, down) experts: packed blocks moedesk computes from, or float16 to be converted.
LAYER_FORMATS = (("q4_0", "q8_0"), ("q4_k", "q8_0"), ("q4_k", "q4_k"), (None, None))
_GGML = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k": "Q4_K"}


def write_moe_gguf(path, layers=LAYER_FORMATS, H=256, F=256, E=4, split_max_tensors=0,
                   endianess=None, rope_freqs=None, arch="llama", seed=0) -> list:
    """A Mixtral-like GGUF (llama architecture with experts, as llama.cpp writes Mixtral) whose layers hold their
    experts as `layers` says, with a SentencePiece vocabulary in its header. Block data is random bytes: only the
    header matters here. Returns the files written: one, or the parts of a split GGUF (`split_max_tensors`)."""
    rng = np.random.default_rng(seed)
    pieces, scores, types = spm_vocab()
    kwargs = {"split_max_tensors": split_max_tensors}
    if endianess is not None:
        kwargs["endianess"] = endianess
    w = gguf.GGUFWriter(str(path), arch, **kwargs)
    w.add_block_count(len(layers)); w.add_context_length(512); w.add_embedding_length(H)
    w.add_feed_forward_length(F); w.add_head_count(4); w.add_head_count_kv(2); w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(H // 4); w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E)
    w.add_expert_used_count(2); w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")

    def f16(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    def add(name, fmt, *shape):
        if fmt is None:
            w.add_tensor(name, f16(*shape))
            return
        kind = gguf.GGMLQuantizationType[_GGML[fmt]]
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
        w.add_tensor(name, rng.integers(0, 256, byte_shape, dtype=np.uint8), raw_dtype=kind)

    kv = 2 * H // 4
    add("token_embd.weight", None, len(pieces), H)
    add("output.weight", "q8_0", len(pieces), H)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i, (gate_up, down) in enumerate(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        add(p + "attn_q.weight", None, H, H); add(p + "attn_k.weight", None, kv, H)
        add(p + "attn_v.weight", None, kv, H); add(p + "attn_output.weight", None, H, H)
        add(p + "ffn_gate_inp.weight", None, E, H)
        add(p + "ffn_gate_exps.weight", gate_up, E, F, H)
        add(p + "ffn_up_exps.weight", gate_up, E, F, H)
        add(p + "ffn_down_exps.weight", down, E, H, F)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return sorted(path.parent.glob(f"{path.stem}*.gguf"))


def assert_same_as_reader(header, file) -> None:
    reader = gguf.GGUFReader(str(file))
    fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(header.fields) == list(fields)
    for name, field in fields.items():
        assert header.fields[name].types == field.types, name
        assert header.fields[name].contents() == field.contents(), name
    assert [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_bytes) for t in header.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset, int(t.n_bytes)) for t in reader.tensors]
    assert header.data_offset == reader.data_offset and header.alignment == reader.alignment


@pytest.mark.parametrize("endian", ["little", "big"])
def test_the_header_reads_as_gguf_s_reader_reads_it(tmp_path, endian):
    kind = gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE
    [file] = write_moe_gguf(tmp_path / "m.gguf", endianess=kind)
    data = file.read_bytes()
    header = parse_header(data, file)
    assert_same_as_reader(header, file)
    assert header.header_bytes <= header.data_offset < len(data)
    # The header's own bytes are all it takes.
    assert_same_as_reader(parse_header(data[:header.header_bytes], file), file)


def test_every_shorter_prefix_asks_for_more(tmp_path):
    [file] = write_moe_gguf(tmp_path / "m.gguf")
    data = file.read_bytes()
    end = parse_header(data, file).header_bytes
    for n in sorted({0, 1, 3, 4, 8, 23, 24, 100, 1000, end // 2, end - 9, end - 1} | set(range(0, end, 97))):
        with pytest.raises(HeaderIncomplete) as excinfo:
            parse_header(data[:n], file)
        assert n < excinfo.value.needed <= end


def test_split_parts_hold_the_metadata_first_and_the_tensors_spread(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    [whole] = write_moe_gguf(tmp_path / "a" / "m.gguf")
    parts = write_moe_gguf(tmp_path / "b" / "m.gguf", split_max_tensors=12)
    assert len(parts) > 2 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    headers = [parse_header(p.read_bytes(), p) for p in parts]
    for header, part in zip(headers, parts):
        assert_same_as_reader(header, part)
    assert "general.architecture" in headers[0].fields and "general.architecture" not in headers[1].fields
    merged = merge_parts(headers, parts[0])
    assert [t.name for t in merged.tensors] == [t.name for t in parse_header(whole.read_bytes(), whole).tensors]
    expected = summarize_path(whole)
    got = summarize_gguf_header(headers, parts[0])
    for dtype in ("auto", "int4", "bf16"):
        assert got.estimate(dtype, "bfloat16") == expected.estimate(dtype, "bfloat16")
    with pytest.raises(CheckpointError, match=f"split in {len(parts)} files, but {len(parts) - 1} parts were found"):
        merge_parts(headers[:-1], parts[0])
    with pytest.raises(CheckpointError, match=f"not part {len(parts)} of the GGUF split"):  # part 2 again, last
        merge_parts(headers[:-1] + [headers[1]], parts[0])


def test_the_estimate_from_the_header_equals_the_one_from_the_file(tmp_path):
    [file] = write_moe_gguf(tmp_path / "m.gguf")
    header = parse_header(file.read_bytes(), file)
    expected, got = summarize_path(file), summarize_gguf_header(header, file)
    assert got.config == expected.config and got.stored == expected.stored
    assert set(got.stored.values()) == {"q4_0", "q8_0", "q4_k", "F16"}  # a float one by its GGML type
    for dtype in ("auto", "bf16", "int8", "int4"):
        for weights in ("float32", "bfloat16"):
            assert got.estimate(dtype, weights) == expected.estimate(dtype, weights)


def test_rope_factors_need_their_data(tmp_path):
    """The one tensor a config depends on: with its data attached, ones load and other factors are refused as
    the file on disk is; the header alone does not have them."""
    [ones] = write_moe_gguf(tmp_path / "ones.gguf", rope_freqs=np.ones(32))
    [scaled] = write_moe_gguf(tmp_path / "scaled.gguf", rope_freqs=np.linspace(1, 8, 32))
    for file in (ones, scaled):
        data = file.read_bytes()
        header = parse_header(data, file)
        t = next(t for t in header.tensors if t.name == "rope_freqs.weight")
        assert t.data is None and t.n_bytes == 32 * 4
        with_data = t.with_data(data[t.data_offset:t.data_offset + t.n_bytes])
        np.testing.assert_array_equal(with_data.data, gguf.GGUFReader(str(file)).tensors[3].data)
        header = replace(header, tensors=[with_data if x is t else x for x in header.tensors])
        if file is ones:
            assert summarize_gguf_header(header, file).estimate() == summarize_path(file).estimate()
        else:
            with pytest.raises(UnsupportedModelError, match="rope_freqs"):
                summarize_gguf_header(header, file)
            with pytest.raises(UnsupportedModelError, match="rope_freqs"):
                summarize_path(file)


# -- files that are not GGUF, in one line ----------------------------------------------------------------------

def header_bytes(version=3, tensors=0, kvs=b"", kv_count=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kv_count) + kvs


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("data, message", [
    (b"PK\x03\x04 a zip file", "not a GGUF file (bad magic)"),
    (b"\x00" * 64, "not a GGUF file (bad magic)"),
    (header_bytes(version=1), "GGUF version 1 is not supported (supported: 2, 3)"),
    (header_bytes(kv_count=1, kvs=gguf_string(b"a.key") + struct.pack("<I", 99)),
     "corrupt GGUF header (unknown value type 99 for 'a.key')"),
    (header_bytes(kv_count=2, kvs=2 * (gguf_string(b"k") + struct.pack("<IB", 0, 7))),
     "corrupt GGUF header (metadata key 'k' twice)"),
    (header_bytes(kv_count=1, kvs=gguf_string(b"k") + struct.pack("<I", 8) + gguf_string(b"\xff\xfe")),
     "corrupt GGUF header (the value of 'k' is not UTF-8)"),
    (header_bytes(tensors=1, kvs=gguf_string(b"t") + struct.pack("<I", 9)), "tensor t has 9 dimensions"),
    (header_bytes(tensors=1, kvs=gguf_string(b"t") + struct.pack("<IQIQ", 1, 32, 4242, 0)),
     "tensor t has unknown type 4242"),
    (header_bytes(tensors=2, kvs=2 * (gguf_string(b"t") + struct.pack("<IQIQ", 1, 32, 0, 0))),
     "corrupt GGUF header (tensor t twice)"),
    (header_bytes(kv_count=1, kvs=gguf_string(b"general.alignment") + struct.pack("<II", 4, 24)),
     "general.alignment 24 is not a power of two"),
])
def test_bad_headers_are_one_line(data, message):
    with pytest.raises(CheckpointError) as excinfo:
        parse_header(data, "repo/x.gguf")
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value) and str(excinfo.value).startswith("repo/x.gguf: ")
