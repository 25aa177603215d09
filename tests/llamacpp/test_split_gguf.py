"""A GGUF split in parts (tests/gguf_split.py) on llama.cpp: llama-cpp-python's own Llama loads the parts written here
(so they are a real split in llama.cpp's format) and decodes as from the single file; moedesk's llama.cpp engine,
given any part, loads the first and decodes as from the single file, placing experts from every part's tensors; and
`--engine auto` routes a split file exactly as the single one: natively where the native engine runs the
architecture (Qwen3-MoE), to llama.cpp where it does not (LFM2-MoE)."""
from __future__ import annotations

import pytest

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build
from tests.gguf_split import split_gguf
from tests.reference import llama_greedy

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return"]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3moe", "lfm2moe"])
def split(request, tmp_path_factory):
    """(family, the single file, its 3 parts, its 3 parts with the metadata alone in the first)."""
    folder = tmp_path_factory.mktemp(request.param)
    single = build(request.param, folder / "hf").gguf
    return (request.param, single, split_gguf(single, folder / "parts" / "m.gguf", 3),
            split_gguf(single, folder / "bare" / "m.gguf", 3, first_empty=True))


def reference_greedy(path) -> list[list[int]]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        return [llama_greedy(llm, llm.tokenize(p.encode(), add_bos=False, special=True), NEW_TOKENS) for p in PROMPTS]
    finally:
        llm.close()


def test_llama_cpp_itself_loads_the_parts_and_decodes_as_from_the_single_file(split):
    _, single, parts, bare = split
    expected = reference_greedy(single)
    assert all(expected)
    assert reference_greedy(parts[0]) == expected
    assert reference_greedy(bare[0]) == expected  # the first part without tensors (--no-tensor-first-split)


def engine_greedy(model: str, engine: str):
    loaded = Engine.load(model, engine=engine, context_length=128)
    try:
        requests = [Request(loaded.tokenizer.encode(p), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
                    for p in PROMPTS]
        return loaded.kind, loaded.why, getattr(loaded, "placement", None), \
            [c.token_ids for c in loaded.complete(requests)]
    finally:
        getattr(loaded, "close", lambda: None)()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_llama_cpp_engine_runs_any_part_as_the_single_file(split):
    _, single, parts, bare = split
    kind, _, placement, expected = engine_greedy(str(single), "llama.cpp")
    assert kind == "llama.cpp" and all(expected) and placement.expert_bytes_in_ram > 0
    for given in (parts[2], bare[1], bare[0].parent):
        kind, _, placed, ids = engine_greedy(str(given), "llama.cpp")
        assert ids == expected, given
        assert placed == placement, given  # the experts' sizes per layer come from every part


@pytest.mark.usefixtures("one_torch_thread")
def test_auto_routes_a_split_gguf_as_the_single_file(split):
    family, single, parts, _ = split
    kind, why, _, expected = engine_greedy(str(single), "auto")
    assert kind == ("native" if family == "qwen3moe" else "llama.cpp"), why
    got = engine_greedy(str(parts[1]), "auto")
    assert got[:2] == (kind, why) and got[3] == expected


def test_a_missing_or_foreign_part_is_one_line_before_llama_cpp_reads_anything(split, tmp_path):
    from moedesk.engine.errors import CheckpointError

    _, _, parts, bare = split
    copies = []
    for p in parts:
        copies.append(tmp_path / p.name)
        copies[-1].write_bytes(p.read_bytes())
    copies[1].unlink()
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(copies[2]), engine="llama.cpp", context_length=128)
    assert str(e.value) == f"{copies[1]}: missing: part 2 of the GGUF split in 3 files that {copies[0].name} begins"
    copies[1].write_bytes(bare[1].read_bytes())  # the same model split otherwise: its tensors overlap part 1's
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(copies[0]), engine="llama.cpp", context_length=128)
    assert str(e.value).startswith(f"{copies[1]}: tensor ") and "is also in" in str(e.value), str(e.value)
