"""`moedesk batch` end to end on real tiny models: exact greedy tokens, bad lines, exit codes, resume."""
import json

import pytest

from moedesk.app.cli import main
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model
from tests.tiny_models import ARCHS

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Experts"]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batch_greedy_equals_transformers(arch, tiny_checkpoint, tmp_path, capsys):
    folder = tiny_checkpoint(arch)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    code = main(["batch", str(src), "-o", str(out), "--model", str(folder), "--temperature", "0",
                 "--dtype", "float32", "--max-new-tokens", "24", "--device", "cpu", "--batch-size", "2"])
    assert code == 0
    results = read_jsonl(out)
    assert [r["id"] for r in results] == ["p0", "p1", "p2"]
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    for r, prompt in zip(results, PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        assert r["token_ids"] == hf_greedy(hf_model(folder), ids, 24, eos)
        assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(r["token_ids"])}
        assert r["text"] == engine.tokenizer.decode(r["token_ids"])


def test_batch_takes_its_defaults_from_the_app_settings(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from moedesk.app.tui.settings import Settings, save_settings

    save_settings(Settings(temperature=0, max_new_tokens=5, gpu_budget_gib=0.5, dtype="bfloat16"))  # test's config dir
    load, dtypes = Engine.load, []

    def spy(cls, model, **kw):  # what each run's model load was asked for
        dtypes.append(kw["dtype"])
        return load(model, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(spy))
    folder = tiny_checkpoint("mixtral")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "p0", "prompt": PROMPTS[1]}])
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "-o", str(out), "--model", str(folder), "--dtype", "float32",
                 "--device", "cpu"]) == 0
    [result] = read_jsonl(out)
    engine = load(str(folder), device="cpu", dtype="float32")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    assert result["token_ids"] == hf_greedy(hf_model(folder), engine.tokenizer.encode(PROMPTS[1]), 5, eos)
    # Without --dtype the saved setting is the one loaded.
    assert main(["batch", str(src), "-o", str(tmp_path / "bf16.jsonl"), "--model", str(folder), "--device", "cpu"]) == 0
    assert dtypes == ["float32", "bfloat16"] and len(read_jsonl(tmp_path / "bf16.jsonl")[0]["token_ids"]) <= 5


@pytest.fixture
def model(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3_moe"))


def run(model, src, out, *extra):
    return main(["batch", str(src), "-o", str(out), "--model", model, "--device", "cpu", "--temperature", "0",
                 "--max-new-tokens", "6", *extra])


def test_bad_lines_are_reported_and_skipped(model, tmp_path, capsys):
    long_prompt = "fox " * 200
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "Hello"},
        '{"id": "broken", "prompt": ',
        {"prompt": "no id here"},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt": long_prompt},
        {"id": "range", "prompt_ids": [1, 2, 99999]},
        {"id": "both", "prompt": "x", "prompt_ids": [1]},
        {"id": "param", "prompt": "x", "temperature": "hot"},
        {"id": "a", "prompt": "duplicate"},
        {"id": "chat", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "ids", "prompt_ids": [5, 6, 7], "max_new_tokens": 3},
    ])
    out = tmp_path / "out.jsonl"
    assert run(model, src, out, "--context", "64") == 1
    results = read_jsonl(out)
    assert [r.get("id") for r in results] == ["a", None, None, "empty", "long", "range", "both", "param", "a",
                                              "chat", "ids"]
    errors = {i: r["error"] for i, r in enumerate(results) if "error" in r}
    assert set(errors) == {1, 2, 3, 4, 5, 6, 7, 8}
    assert "line 2: malformed JSON" in errors[1]
    assert "missing or non-string id" in errors[2]
    assert "empty prompt" in errors[3]
    assert "the model's context is 64" in errors[4]
    assert "outside the vocabulary" in errors[5]
    assert "exactly one of" in errors[6]
    assert "temperature" in errors[7]
    assert "duplicate id" in errors[8]
    assert len(results[10]["token_ids"]) <= 3
    assert all("\n" not in e for e in errors.values())


def test_usage_errors_exit_2(model, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}])
    assert run(model, tmp_path / "missing.jsonl", tmp_path / "out.jsonl") == 2
    assert "no such input file" in capsys.readouterr().err
    assert run(str(tmp_path / "no-model"), src, tmp_path / "out.jsonl") == 2
    assert "no such model" in capsys.readouterr().err
    assert run(model, src, tmp_path / "nodir" / "out.jsonl") == 2
    with pytest.raises(SystemExit) as e:
        main(["batch", str(src)])  # -o is required
    assert e.value.code == 2


def test_killed_run_resumes_without_duplicates_or_losses(model, tmp_path, monkeypatch, capsys):
    lines = [{"id": f"q{i}", "prompt": f"The quick brown fox {i}", "max_new_tokens": 4 + i % 3} for i in range(7)]
    lines.insert(3, "{not json")
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    reference = tmp_path / "reference.jsonl"
    assert run(model, src, reference) == 1
    expected = read_jsonl(reference)

    out = tmp_path / "out.jsonl"
    real_generate = Engine.generate

    def dies_after_three(self, requests, batch_size=8, decoding=None):
        for n, completion in enumerate(real_generate(self, requests, batch_size, decoding)):
            if n == 3:
                raise KeyboardInterrupt
            yield completion

    monkeypatch.setattr(Engine, "generate", dies_after_three)
    assert run(model, src, out, "--batch-size", "3") == 130
    monkeypatch.setattr(Engine, "generate", real_generate)
    partial = read_jsonl(out)
    assert 0 < len(partial) < len(expected)
    with open(out, "a") as f:
        f.write('{"id": "q9", "text": "half a li')  # a crash in the middle of writing a line
    assert run(model, src, out, "--batch-size", "3") == 1
    resumed = read_jsonl(out)
    strip = [{k: v for k, v in r.items() if k != "stats"} for r in resumed]
    assert strip == [{k: v for k, v in r.items() if k != "stats"} for r in expected]
    assert run(model, src, out) == 1  # a third run has nothing left to do and writes nothing
    assert len(read_jsonl(out)) == len(expected)


def test_all_good_exits_0_and_reports_stats(model, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt_ids": [3, 4]}])
    out = tmp_path / "out.jsonl"
    assert run(model, src, out) == 0
    err = capsys.readouterr().err
    assert "2 ok, 0 failed" in err
    assert all(r["finish_reason"] in ("stop", "length") and "ttft_s" in r["stats"] for r in read_jsonl(out))


def test_an_out_of_memory_back_off_gives_the_cache_back_and_the_tokens_stay(model, tmp_path):
    """A batch that halves its rows after running out of memory gives the KV cache's memory back (it only ever
    grew, so the halved batch kept every row of the full one) and still writes what a run that never ran out
    writes."""
    import io

    from moedesk.app.batch import BatchSettings, run_batch

    engine = Engine.load(model, device="cpu", dtype="float32")
    lines = [{"id": f"q{i}", "prompt": "The quick brown fox " * (1 + i % 3) + str(i)} for i in range(10)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    settings = BatchSettings(temperature=0, max_new_tokens=12, ignore_eos=True, batch_size=4)
    assert run_batch(src, tmp_path / "reference.jsonl", engine, settings, stderr=io.StringIO(), progress=False) == 0
    full = engine.cache.nbytes()

    forward, seen = engine.model.forward, {}

    def short_of_memory(tokens, *args, **kwargs):  # the third decode step of 4 rows runs out, once
        if "oom" in seen and tokens.shape[0] <= 2:  # the lines it held, alone, then the halved batch
            seen["after"] = max(seen.get("after", 0), engine.cache.nbytes())
        elif tokens.shape == (4, 1):
            seen["steps"] = seen.get("steps", 0) + 1
            if seen["steps"] == 3:
                seen["oom"] = engine.cache.nbytes()
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return forward(tokens, *args, **kwargs)

    engine.model.forward = short_of_memory
    err = io.StringIO()
    try:
        assert run_batch(src, tmp_path / "out.jsonl", engine, settings, stderr=err, progress=False) == 0
    finally:
        del engine.model.forward
        engine.scheduler.close()
    assert "going on with 2" in err.getvalue()
    assert seen["oom"] == full  # what the full batch held when it ran out
    assert seen["after"] < full and engine.cache.nbytes() < full and engine.cache.rows <= 2
    strip = lambda records: [{k: v for k, v in r.items() if k != "stats"} for r in records]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "out.jsonl")) == strip(read_jsonl(tmp_path / "reference.jsonl"))


def test_ctrl_c_on_a_real_process_exits_130_and_the_rerun_completes(model, tmp_path):
    """A real `moedesk batch` process interrupted mid-run (SIGINT, as Ctrl-C sends it): it must end with its one
    line and exit 130, not abort in the engine's decode thread (which it did, exit 134), and leave whole lines
    that the same command completes."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.ctrl_c import sigint_as_at_a_terminal

    lines = [{"id": f"q{i}", "prompt": f"The quick brown fox {i}", "max_new_tokens": 16} for i in range(120)]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "moedesk", "batch", str(src), "-o", str(out), "--model", model, "--device",
               "cpu", "--temperature", "0", "--ignore-eos", "--batch-size", "4"]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE, text=True,
                               preexec_fn=sigint_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.stat().st_size > 0) and process.poll() is None:
            assert time.monotonic() < deadline, "no output line in 60 s"
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        err = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err[-2000:]
    assert err.rstrip().endswith("moedesk: interrupted") and "terminate called" not in err
    partial = read_jsonl(out)  # whole lines only (read_jsonl fails on a cut one)
    assert 0 < len(partial) < len(lines) and out.read_text().endswith("\n")
    assert [r["id"] for r in partial] == [f"q{i}" for i in range(len(partial))]

    assert main(["batch", str(src), "-o", str(out), "--model", model, "--device", "cpu", "--temperature", "0",
                 "--ignore-eos", "--batch-size", "16"]) == 0
    resumed = read_jsonl(out)
    assert resumed[:len(partial)] == partial
    assert [r["id"] for r in resumed] == [f"q{i}" for i in range(len(lines))]


def test_a_draft_head_that_does_not_load_is_a_usage_error_before_any_line(model, tmp_path, capsys):
    # A bad --draft used to fail the speculative job's every step instead: each line then ran again alone, plainly,
    # so the whole run went one line at a time without the speculation asked for, and exited 0.
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt_ids": [3, 4]}])
    out = tmp_path / "out.jsonl"
    (tmp_path / "head").mkdir()
    assert run(model, src, out, "--speculative", "greedy", "--draft", str(tmp_path / "head")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moedesk: ") and "config.json" in err[-1], err
    assert not any("ok," in line for line in err)  # the run never started
    assert not out.exists() or out.read_text() == ""


def test_batch_lines_survive_byte_tokens_that_break_decodestream(tmp_path):
    """The synthetic GGUF writer's model (random weights, a vocabulary half <0xXX> byte tokens) answers with byte
    runs that tokenizers' DecodeStream cannot stream: every line failed on the GPU box. Now each gets its text."""
    from moedesk.bench.synthetic_gguf import write_f16
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
    from moedesk.engine.load.synthetic import shape_config

    model = tmp_path / "tiny-moe.gguf"
    write_f16(shape_config("tiny-moe", 2), model)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": "Hello there", "seed": i} for i in range(4)])
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "-o", str(out), "--model", str(model), "--temperature", "1",
                 "--max-new-tokens", "48", "--dtype", "float32", "--device", "cpu"]) == 0
    results = read_jsonl(out)
    assert [r["id"] for r in results] == ["p0", "p1", "p2", "p3"] and not any("error" in r for r in results)
    tokenizer = GGUFCheckpoint(model).tokenizer
    texts = [tokenizer.decode(r["token_ids"]) for r in results]
    assert [r["text"] for r in results] == texts and all("t" in t and "\ufffd" in t for t in texts)
