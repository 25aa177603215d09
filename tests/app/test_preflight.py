"""Commands refuse what cannot work before the slow part: a port in use before the model loads, a model that does
not fit the memory before it is built or read (issue 46, items 5 and 6)."""
import socket

from moedesk.app.cli import main
from moedesk.app.ports import check_port
from moedesk.engine.runtime import Engine


def test_serve_checks_the_port_before_loading(monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(Engine, "load", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moedesk: --port {port}: cannot listen on 127.0.0.1:{port} (already in use); choose another " \
                  f"with --port"


def test_a_free_port_and_a_bad_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)  # free again: no error
    try:
        check_port("no.such.host.invalid", port)
    except Exception as e:  # noqa: BLE001
        assert str(e).startswith("--host no.such.host.invalid: not an address")
    else:
        raise AssertionError("a host that does not resolve was accepted")


class _Memory:
    def __init__(self, available):
        self.available = available


def test_bench_refuses_a_model_bigger_than_the_ram_naming_layers_that_fit(monkeypatch, capsys):
    import psutil

    from moedesk.engine.load.synthetic import shape_config
    from moedesk.engine.memory_fit import model_bytes, usable

    available = 23 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(available))
    assert main(["bench", "--device", "cpu"]) == 2  # float32 Mixtral-8x7B: ~175 GiB
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moedesk: bench: mixtral-8x7b x32 layers needs ") and "23.0 GiB is available" in line
    layers = int(line.rsplit("--layers ", 1)[1])
    cfg = shape_config("mixtral-8x7b")
    assert model_bytes(cfg, layers, 4, 32) <= usable(available) < model_bytes(cfg, layers + 1, 4, 32)


def test_a_model_load_refuses_what_the_ram_cannot_hold_naming_an_expert_dtype(tiny_checkpoint, tmp_path, monkeypatch,
                                                                           capsys):
    import moedesk.engine.runtime as runtime
    from moedesk.engine.load.size_estimate import summarize_path

    folder = tiny_checkpoint("mixtral")
    weights = summarize_path(folder)
    full, int8 = (weights.estimate(e, "float32").ram_bytes(False) for e in ("auto", "int8"))
    assert int8 < full
    monkeypatch.setattr(runtime, "available_ram", lambda: int((int8 + full) / 2 / 0.9))
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n')
    capsys.readouterr()
    code = main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(folder), "--device", "cpu",
                 "--dtype", "float32"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert code == 2 and line.startswith(f"moedesk: {folder} needs ") and line.endswith("try --expert-dtype int8")
    monkeypatch.setattr(runtime, "available_ram", lambda: 64 * 2**30)
    assert main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(folder), "--device", "cpu",
                 "--dtype", "float32", "--max-new-tokens", "2"]) == 0


def test_chat_refuses_a_draft_head_that_is_not_there_before_the_app_opens(monkeypatch, capsys, tmp_path):
    import moedesk.app.tui as tui

    monkeypatch.setattr(tui, "run_app", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the app opened")))
    assert main(["chat", "--speculative", "greedy", "--draft", "/no/such"]) == 2
    assert capsys.readouterr().err.strip() == ("moedesk: --draft /no/such: not an EAGLE draft head folder (no such "
                                               "folder; `moedesk train-draft` makes one)")
    assert main(["chat", "--speculative", "greedy", "--draft", str(tmp_path)]) == 2
    assert "no config.json in it" in capsys.readouterr().err


def test_bench_on_the_demo_takes_its_shipped_head(monkeypatch, tmp_path):
    # Issue 46, item 7: `bench --model demo --prompts F` asked for --draft although the demo ships a head.
    import moedesk.bench.speculative as speculative
    from moedesk.engine.speculative.demo_draft import demo_head_folder

    seen = {}
    monkeypatch.setattr(Engine, "load", staticmethod(lambda model, **kwargs: type("E", (), {"tokenizer": None})()))
    monkeypatch.setattr(speculative, "load_prompts", lambda *a: [[1, 2]])

    def run_draft_bench(engine, draft, *args, **kwargs):
        seen["draft"] = draft
        return {}

    monkeypatch.setattr(speculative, "run_draft_bench", run_draft_bench)
    monkeypatch.setattr(speculative, "format_draft", lambda report: "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('"a prompt"\n')
    assert main(["bench", "--model", "demo", "--prompts", "p.jsonl"]) == 0
    assert seen["draft"] == str(demo_head_folder())


def test_bench_names_a_prompts_file_that_is_not_there_before_loading(monkeypatch, capsys, tmp_path):
    # Found on a fresh machine: a mistyped --prompts path ended in a FileNotFoundError traceback.
    import pytest

    from moedesk.bench.speculative import load_prompts
    from moedesk.engine.errors import MoedeskError

    monkeypatch.setattr(Engine, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the model loaded")))
    missing = tmp_path / "no-such.jsonl"
    assert main(["bench", "--model", "demo", "--prompts", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"moedesk: --prompts {missing}: no such file"
    with pytest.raises(MoedeskError, match="cannot read it"):
        load_prompts(tmp_path, None)  # a folder: read fails, one line


def test_train_draft_that_fails_before_training_leaves_no_empty_folder(capsys, tmp_path):
    # Found on a fresh machine: the README's `train-draft --model M --out DIR` left an empty DIR behind.
    out, kept = tmp_path / "new" / "head", tmp_path / "kept"
    kept.mkdir()
    assert main(["train-draft", "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 2
    assert "no such model folder" in capsys.readouterr().err
    assert not out.exists()
    assert main(["train-draft", "--model", str(tmp_path / "no-model"), "--out", str(kept)]) == 2
    assert kept.is_dir()  # a folder the user had stays
