"""`moedesk bench --gguf FILE` on the native engine: the file itself, loaded as the app loads it, measured by the
bench's runs. llama-bench reads the same file, so the two sides' routers pick the same experts (a synthetic model of
the same shape routes otherwise: docs/measurements.md, "Session 50")."""
import json
import sys

import pytest

from moedesk.app.cli import main


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    """tests/perf/make_family_gguf.py's gpt-oss file at toy sizes, 2 layers: MXFP4 experts, llama.cpp's names."""
    from tests.perf import make_family_gguf

    out = tmp_path_factory.mktemp("bench_file") / "gpt-oss-20b.gguf"
    argv = sys.argv
    sys.argv = ["make_family_gguf.py", "gpt-oss-20b", str(out), "2", "--tiny"]
    try:
        make_family_gguf.main()  # in this process: a child would spend most of its time importing transformers
    finally:
        sys.argv = argv
    return out


def test_the_file_is_measured_with_its_own_layers_formats_and_routers(gpt_oss_file, capsys, monkeypatch, tmp_path):
    from gguf import GGUFReader

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    args = ["bench", "--gguf", str(gpt_oss_file), "--device", "cpu", "--decode-tokens", "4", "--prefill", "16",
            "--batch", "2", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    fields = {f.name: f.contents() for f in GGUFReader(gpt_oss_file).fields.values()
              if f.name in ("gpt-oss.block_count", "gpt-oss.expert_count")}
    layers, experts = fields["gpt-oss.block_count"], fields["gpt-oss.expert_count"]
    # Before, the native bench ignored --gguf and measured the default shape, Mixtral-8x7B.
    assert (report["shape"], report["layers"], report["experts"]) == (gpt_oss_file.name, layers, "mxfp4")
    runs = {r["mode"]: r for r in report["results"]}
    assert set(runs) == {"decode", "prefill", "batched_decode"} and all(r["tok_s"] > 0 for r in runs.values())
    prefill = runs["prefill"]
    # 16 tokens, the file's top-k of its experts in each of its layers, every round
    used = prefill["experts"]["active_experts"] / prefill["rounds"]
    assert 0 < used <= layers * experts
    assert report["experts_on_gpu"] == 0  # --gpu-budget 0 (the default): every expert in RAM


@pytest.mark.parametrize("extra, named", [(["--shape", "gpt-oss-120b"], "--shape"), (["--layers", "1"], "--layers"),
                                          (["--expert-format", "q4_k"], "--expert-format"),
                                          (["--routing", "no-locality"], "--routing"),
                                          (["--speculative"], "speculation")])
def test_what_shapes_a_synthetic_model_is_refused_beside_a_file_in_one_line(gpt_oss_file, capsys, extra, named):
    assert main(["bench", "--gguf", str(gpt_oss_file), "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bench --gguf" in err and named in err, err
