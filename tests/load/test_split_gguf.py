"""A GGUF split in parts (llama.cpp's gguf-split layout, tests/gguf_split.py) opens as the one file it was split from:
the native engine's greedy ids, tensors, size estimate and listing are the single file's, from any part or the folder;
a missing part, or a part of another model, is one line naming it. llama.cpp's side: tests/llamacpp/test_split_gguf.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moedesk.app.tui.catalog import scan_models_dir
from moedesk.engine.errors import CheckpointError
from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
from moedesk.engine.load.gguf_split import part_paths, split_stem
from moedesk.engine.load.size_estimate import summarize_path
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build
from tests.gguf_split import split_gguf
from tests.load.test_bad_input import batch_error

# Qwen3-MoE (float experts), GLM-4.5's shape (a dense first layer, shared experts) and gpt-oss with MXFP4 experts
# kept packed (read_packed's slices of a stacked tensor, from the part holding it).
FAMILIES = ["qwen3moe", "glm4moe", "gpt-oss-mxfp4"]
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return"]


@pytest.fixture(scope="module", params=FAMILIES)
def split(request, tmp_path_factory):
    """(the single file, its 3 parts, its 3 parts with the metadata alone in the first)."""
    folder = tmp_path_factory.mktemp(request.param)
    single = build(request.param, folder / "hf").gguf
    return (single, split_gguf(single, folder / "parts" / "m.gguf", 3),
            split_gguf(single, folder / "bare" / "m.gguf", 3, first_empty=True))


def greedy(model: str) -> list[list[int]]:
    engine = Engine.load(model, device="cpu", dtype="float32", engine="native")
    requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=12, temperature=0)) for p in PROMPTS]
    return [c.token_ids for c in engine.complete(requests)]


def test_the_native_engine_runs_a_split_gguf_as_the_single_file(split, one_torch_thread):
    single, parts, bare = split
    expected = greedy(str(single))
    assert all(expected)
    assert greedy(str(parts[2])) == expected  # any part names the model
    assert greedy(str(bare[0].parent)) == expected  # and so does the folder holding it


def test_every_tensor_reads_as_from_the_single_file(split):
    single, parts, bare = split
    whole = GGUFCheckpoint(single)
    for given in (parts[1], bare[2]):
        checkpoint = GGUFCheckpoint(given)
        assert checkpoint.path == part_paths(given)[0] and checkpoint.parts == tuple(part_paths(given))
        assert checkpoint.config == whole.config and checkpoint.tokenizer_config == whole.tokenizer_config
        assert sorted(checkpoint.keys()) == sorted(whole.keys())
        for name in whole.keys():
            fmt = whole.packed_format(name)
            assert checkpoint.packed_format(name) == fmt, name
            if fmt is None:
                assert torch.equal(checkpoint.get_tensor(name), whole.get_tensor(name)), name
            else:
                ours, theirs = (torch.empty(whole_bytes(whole, name), dtype=torch.uint8) for _ in range(2))
                checkpoint.read_packed(name, ours)
                whole.read_packed(name, theirs)
                assert torch.equal(ours, theirs), name
        checkpoint.close()
    whole.close()


def whole_bytes(checkpoint: GGUFCheckpoint, name: str) -> int:
    gguf_name, expert = checkpoint._index[name]
    data = checkpoint._tensors[gguf_name].data
    return int((data if expert is None else data[expert]).size)


def test_the_size_estimate_of_a_split_gguf_is_the_single_files(split):
    single, parts, bare = split
    expected = summarize_path(single)
    for given in (parts[0], parts[2], bare[0].parent):
        got = summarize_path(given)
        for dtype in ("auto", "int4", "bf16"):
            assert got.estimate(dtype, "bfloat16") == expected.estimate(dtype, "bfloat16"), given
    # On disk the parts add up to the single file and the headers of the parts after the first.
    listed = [m for m in scan_models_dir(parts[0].parent.parent) if m.source == "gguf"]
    assert [Path(m.spec).name for m in listed] == ["m-00001-of-00003.gguf", "m-00001-of-00003.gguf"]
    extra = listed[0].size_bytes - single.stat().st_size
    assert listed[0].size_bytes == sum(p.stat().st_size for p in parts) and 0 < extra < 3 * 4096
    assert listed[0].estimate("auto", "bfloat16") == expected.estimate("auto", "bfloat16")


def test_the_listing_shows_one_model_for_its_parts(tmp_path):
    folder = tmp_path / "models"
    (folder / "a").mkdir(parents=True)
    for name in ("m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "other.gguf", "mmproj-x.gguf"):
        (folder / "a" / name).write_bytes(b"GGUF")
    assert split_stem(folder / "a" / "m-00002-of-00002.gguf") == folder / "a" / "m"
    names = [m.name for m in scan_models_dir(folder)]
    assert names.count("m-00001-of-00002.gguf") == 1 and "m-00002-of-00002.gguf" not in names
    assert "other.gguf" in names


@pytest.fixture(scope="module")
def mixtral_parts(tmp_path_factory):
    """A tiny Mixtral GGUF in 3 parts, and a tiny Qwen3-MoE's in 3 parts: another model's."""
    from tests.load.test_gguf_checkpoint import write_tiny_mixtral

    folder = tmp_path_factory.mktemp("mixtral")
    write_tiny_mixtral(folder / "tiny.gguf")
    qwen = build("qwen3moe", folder / "qwen").gguf
    return (split_gguf(folder / "tiny.gguf", folder / "parts" / "tiny.gguf", 3),
            split_gguf(qwen, folder / "qwen-parts" / "tiny.gguf", 3),
            split_gguf(folder / "tiny.gguf", folder / "two" / "tiny.gguf", 2))


def copy_parts(parts: list[Path], folder: Path) -> list[Path]:
    folder.mkdir(parents=True)
    for p in parts:
        (folder / p.name).write_bytes(p.read_bytes())
    return [folder / p.name for p in parts]


def test_a_missing_part_is_one_line_naming_it(mixtral_parts, tmp_path, capsys):
    parts = copy_parts(mixtral_parts[0], tmp_path / "m")
    parts[1].unlink()
    for given in (parts[0], parts[2], parts[0].parent):
        line = batch_error(given, tmp_path, capsys)
        assert line == f"moedesk: {parts[1]}: missing: part 2 of the GGUF split in 3 files that {parts[0].name} begins"


def test_a_part_of_another_model_is_one_line_naming_it(mixtral_parts, tmp_path, capsys):
    mixtral, qwen, halves = mixtral_parts
    parts = copy_parts(mixtral, tmp_path / "m")
    parts[1].write_bytes(qwen[1].read_bytes())  # another model split in as many parts
    line = batch_error(parts[0], tmp_path, capsys)
    assert line.startswith(f"moedesk: {parts[1]}: not part 2 of the GGUF split that {parts[0].name} begins") \
        and "a part of another model?" in line, line
    parts[1].write_bytes(halves[1].read_bytes())  # the same model split in 2: the second of 2
    line = batch_error(parts[2], tmp_path, capsys)
    assert line.startswith(f"moedesk: {parts[1]}: not part 2 of the GGUF split that {parts[0].name} begins") \
        and "says part 2 of 2" in line, line


def test_a_part_renamed_out_of_the_convention_says_the_others_cannot_be_found(mixtral_parts, tmp_path):
    lone = tmp_path / "renamed.gguf"
    lone.write_bytes(mixtral_parts[0][0].read_bytes())
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(lone)
    assert str(e.value) == (f"{lone}: part 1 of a GGUF split in 3 files, named without llama.cpp's "
                            f"-NNNNN-of-00003 suffix: its other parts cannot be found")


def test_a_downloaded_split_gguf_in_the_hub_cache_opens_from_its_repo_id(mixtral_parts, tmp_path, monkeypatch):
    """A repo id whose cached snapshot holds one split quantisation in a sub-folder is that GGUF."""
    import moedesk.engine.load.checkpoint as checkpoint

    snapshot = tmp_path / "snapshot"
    parts = copy_parts(mixtral_parts[0], snapshot / "Q8_0")
    monkeypatch.setattr(checkpoint, "_cached_repo", lambda repo_id: snapshot)
    opened = open_checkpoint("someone/tiny-GGUF")
    assert opened.path == parts[0] and opened.parts == tuple(parts)
    assert summarize_path(snapshot).estimate() == summarize_path(parts[0]).estimate()


def fake_part(no: int, count: int, total: int, tensors: list[str]):
    from types import SimpleNamespace

    from gguf import GGUFValueType

    from moedesk.engine.load.gguf_header import HeaderField

    values = {"split.no": (no, GGUFValueType.UINT16), "split.count": (count, GGUFValueType.UINT16),
              "split.tensors.count": (total, GGUFValueType.INT32)}
    fields = {k: HeaderField(k, v, [t]) for k, (v, t) in values.items()}
    return SimpleNamespace(fields=fields, tensors=[SimpleNamespace(name=n) for n in tensors])


def test_join_checks_the_parts_as_llama_cpp_does():
    from moedesk.engine.load.gguf_split import join

    names = [Path(f"m-0000{i}-of-00002.gguf") for i in (1, 2)]
    joined = join([fake_part(0, 2, 3, ["a"]), fake_part(1, 2, 3, ["b", "c"])], names)
    assert [t.name for t in joined.tensors] == ["a", "b", "c"] and joined.part_of == {"a": 0, "b": 1, "c": 1}
    cases = [
        ([fake_part(0, 2, 4, ["a"]), fake_part(1, 2, 4, ["b", "c"])], names[0], "holds 3 tensors, but says 4"),
        ([fake_part(0, 2, 3, ["a"]), fake_part(0, 2, 3, ["b", "c"])], names[1], "says part 1 of 2"),
        ([fake_part(0, 3, 3, ["a"]), fake_part(1, 3, 3, ["b"])], names[0], "split in 3 files, but 2 parts were found"),
        ([fake_part(0, 2, 3, ["a", "b"]), fake_part(1, 2, 3, ["b"])], names[1], "tensor b is also in m-00001-of-00002"),
    ]
    for parts, named, says in cases:
        with pytest.raises(CheckpointError) as e:
            join(parts, names)
        assert str(e.value).startswith(f"{named}: ") and says in str(e.value), str(e.value)
    assert part_paths(Path("x/m-00002-of-00003.gguf")) == [Path(f"x/m-0000{i}-of-00003.gguf") for i in (1, 2, 3)]
    assert part_paths(Path("x/m.gguf")) == [Path("x/m.gguf")]
