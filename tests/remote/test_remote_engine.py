"""--engine remote against a real `moedesk serve` of the demo model, started here as users start it."""
import json
import subprocess
import sys
import time

import pytest

from moedesk.app.cli import main
from moedesk.engine.errors import EngineUnavailable
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.app.serve_process import served

KEY = "remote-test-key"
DEMO = ["--model", "demo", "--device", "cpu", "--dtype", "float32", "--batch-size", "4"]
QUESTIONS = ["Name three colours.", "What is the capital of France?"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
STARTUP_S = 300  # the demo server loads its weights first: minutes on a busy 2-core machine


@pytest.fixture(scope="module")
def server():
    with served(DEMO, KEY, STARTUP_S) as (url, _):
        yield url


@pytest.fixture(scope="module")
def local():
    engine = Engine.load("demo", device="cpu", dtype="float32")
    yield engine
    engine.scheduler.close()


def _prompt(engine, question):
    text = engine.tokenizer.render_chat([{"role": "user", "content": question}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_text_equals_the_local_engine(server, local):
    remote = Engine.load("demo", engine="remote", url=server, api_key=KEY)
    try:
        assert remote.kind == "remote" and remote.expert_map() == ([], [])
        assert "not available" in remote.expert_stats()["placement"]
        prompts = [_prompt(remote, q) for q in QUESTIONS]
        assert prompts == [_prompt(local, q) for q in QUESTIONS]  # the same tokenizer and template, read here
        expected = local.complete([Request(p, GREEDY) for p in prompts])
        # streamed: the pieces add up to the local engine's text, token ids included
        chunks = list(remote.stream(prompts[0], GREEDY))
        assert "".join(c.text for c in chunks) == expected[0].text
        assert chunks[-1].completion.token_ids == expected[0].token_ids
        assert chunks[-1].completion.finish_reason == expected[0].finish_reason
        # several at once, through the same face batch runs use
        got = sorted(remote.generate([Request(p, GREEDY, tag=i) for i, p in enumerate(prompts)], batch_size=2),
                     key=lambda c: c.tag)
        assert [c.text for c in got] == [e.text for e in expected]
        assert [c.token_ids for c in got] == [e.token_ids for e in expected]
        assert remote.scheduler.stats()["finished"] == 3
    finally:
        remote.close()


def test_stop_strings_and_response_format_pass_through(server, local):
    remote = Engine.load("demo", engine="remote", url=server, api_key=KEY)
    try:
        prompt = _prompt(remote, QUESTIONS[0])
        full = local.complete([Request(prompt, GREEDY)])[0].text
        stop = full.split()[1]  # a word inside the greedy reply
        params = SamplingParams(max_new_tokens=12, temperature=0, stop=(stop,))
        [done] = remote.complete([Request(prompt, params)])
        assert done.text == full[:full.index(stop)] and done.finish_reason == "stop"
        schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
        shaped = SamplingParams(max_new_tokens=24, temperature=0)
        [there] = remote.complete([Request(prompt, shaped, grammar=remote.grammar(schema))])
        [here] = local.complete([Request(prompt, shaped, grammar=local.grammar(schema))])
        assert there.text == here.text and there.text.startswith('{"n"')  # the server constrained it, as here
    finally:
        remote.close()


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moedesk: "), err
    return err[0]


def test_a_wrong_key_and_a_dead_port_are_one_line_each(server, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    wrong = ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--engine", "remote", "--url", server,
             "--api-key", "not-the-key"]
    assert main(wrong) == 2
    assert "refused the API key" in _one_line(capsys)
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    assert main(wrong[:-4] + ["--engine", "remote", "--url", dead, "--api-key", KEY]) == 2
    assert "cannot reach the server" in _one_line(capsys)
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_batch_resumes_after_the_server_is_killed_mid_run(server, local, tmp_path):
    questions = [f"Count from {i} to {i + 20}, one number a line." for i in range(6)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                              for i, q in enumerate(questions)))
    command = [sys.executable, "-m", "moedesk", "batch", str(source), "-o", str(out), "--engine", "remote",
               "--api-key", KEY, "--max-new-tokens", "24", "--temperature", "0", "--batch-size", "1"]
    with served(DEMO, KEY, STARTUP_S) as (doomed, proc):
        run = subprocess.Popen(command + ["--url", doomed], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (out.exists() and out.read_text().count("\n") >= 1):  # the first line is written: kill it
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.kill()
        proc.wait(10)
        _, err = run.communicate(timeout=120)
    written = out.read_text().splitlines()
    assert run.returncode == 1
    lines = err.strip().splitlines()
    assert len([l for l in lines if l.startswith("moedesk")]) == 1 and "run the same command" in lines[-1], err
    assert 1 <= len(written) < len(questions) and all("error" not in json.loads(l) for l in written)
    # resumed against a server that runs: the lines written stay as they were, the rest follow, none twice
    resumed = subprocess.run(command + ["--url", server], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert out.read_text().splitlines()[:len(written)] == written
    assert [r["id"] for r in records] == [f"q{i}" for i in range(len(questions))]
    prompts = [_prompt(local, q) for q in questions]
    expected = local.complete([Request(p, SamplingParams(max_new_tokens=24, temperature=0)) for p in prompts])
    assert [r["text"] for r in records] == [e.text for e in expected]


def test_remote_engine_refuses_native_only_decoding(server):
    from moedesk.engine.generation.beam import BeamOptions

    remote = Engine.load("demo", engine="remote", url=server, api_key=KEY)
    try:
        with pytest.raises(Exception) as refused:
            list(remote.stream([1, 2, 3], GREEDY, decoding=BeamOptions(2)))
        assert "not available on a remote engine" in str(refused.value)
    finally:
        remote.close()


def test_unavailable_is_an_engine_unavailable_error(server):
    remote = Engine.load("demo", engine="remote", url=server, api_key=KEY)
    remote.url = "http://127.0.0.1:1/v1"  # the server went away after the load
    try:
        with pytest.raises(EngineUnavailable, match="cannot reach"):
            remote.complete([Request([1, 2, 3], GREEDY)])
    finally:
        remote.close()
