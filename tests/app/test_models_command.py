"""`moedesk list`, `rm`, `ps` and `pull`, against a fake Hub (tests/fake_hub.py) and a real `moedesk serve`."""
from __future__ import annotations

import argparse
import io
import json
import random
import socket
from pathlib import Path

import pytest

from moedesk.app import models_command as mc
from moedesk.app import pull_catalogue
from moedesk.app.cli import main
from moedesk.app.download import download
from moedesk.engine.errors import MoedeskError
from tests.app.serve_process import serve_process
from tests.fake_hub import FakeHub, point_client_at

pytestmark = pytest.mark.timeout(120)

ARCH = "qwen3_moe"


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def gguf_bytes(tmp_path: Path, arch: str) -> bytes:
    """A GGUF file whose header names an architecture the native engine does not read: llama.cpp's to run."""
    from gguf import GGUFWriter

    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_checkpoint):
    from huggingface_hub.utils import close_session

    folder = tiny_checkpoint(ARCH)
    fake = FakeHub()
    fake.add_repo("moe/tiny", {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
    fake.add_repo("moe/tiny-GGUF", {"tiny-Q4_K_M.gguf": gguf_bytes(tmp_path, "futuremoe") + blob(1, 200_000),
                                    "tiny-Q8_0.gguf": blob(2, 150_000), "README.md": b"# quants\n"})
    fake.start()
    home = tmp_path / "hf-home"
    point_client_at(fake, monkeypatch, home, home / "hub", 16 * 1024)
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "no-models"))
    monkeypatch.setitem(pull_catalogue.CATALOGUE, "tiny:1b",
                        pull_catalogue.CatalogueEntry("moe/tiny-GGUF", "Q4_K_M", "moe/tiny", "a test model"))
    yield fake
    fake.stop()
    close_session()


def cache_repo(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# -- list ------------------------------------------------------------------------------------------------------

def test_list_shows_cached_models_with_size_format_arch_and_engine(hub, tiny_checkpoint, capsys):
    download("moe/tiny")
    download("moe/tiny-GGUF", include=["*Q4_K_M*"])

    assert main(["list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    tiny = listed["moe/tiny"]
    on_hub = hub.repos["moe/tiny"].files
    assert tiny["format"] == "safetensors" and tiny["arch"] == ARCH and tiny["engine"] == "native"
    assert tiny["where"] == "hf cache" and tiny["size_bytes"] == sum(len(d) for d in on_hub.values())
    config = json.loads(on_hub["config.json"])
    assert tiny["experts"] == f"{config['num_local_experts']} × top-{config['num_experts_per_tok']}"
    gguf = listed["tiny:1b"]  # a repo the catalogue names: by its short name, what --model takes back
    assert pull_catalogue.local_model("tiny:1b").endswith("tiny-Q4_K_M.gguf")
    assert gguf["format"] == "GGUF Q4_K_M" and gguf["arch"] == "futuremoe" and gguf["engine"] == "llama.cpp"
    assert gguf["size_bytes"] == len(hub.repos["moe/tiny-GGUF"].files["tiny-Q4_K_M.gguf"])
    assert "demo" in listed

    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "FORMAT", "SIZE", "ARCH", "EXPERTS", "ENGINE", "FROM"]
    row = next(line for line in table if line.startswith("tiny:1b "))
    assert "GGUF Q4_K_M" in row and "futuremoe" in row and "llama.cpp" in row
    download("moe/tiny-GGUF", include=["*Q8_0*"])  # another quantisation: its tag after the name
    assert main(["list", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert "tiny:1b" in names and "tiny:1b:q8_0" in names
    assert pull_catalogue.short_name("org/not-named", "Q4_K_M") is None


def lfm_repo() -> dict[str, bytes]:
    """A safetensors checkpoint of an architecture the native engine does not implement (LFM2-MoE)."""
    import torch
    from safetensors.torch import save

    config = {"model_type": "lfm2_moe", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 128}
    return {"config.json": json.dumps(config).encode(), "tokenizer.json": b'{"version": "1.0"}',
            "model.safetensors": save({"model.embed_tokens.weight": torch.zeros(128, 64, dtype=torch.bfloat16)})}


def test_list_says_what_the_engine_setting_would_do_with_a_safetensors_checkpoint(hub, capsys):
    """llama.cpp reads GGUF files only: with the engine set to llama.cpp (--engine, else the app's setting) a
    safetensors checkpoint is listed under engine "none", and the line below the table is the one Engine.load stops
    with; one the native engine refuses is "none" under auto too. A GGUF and the demo (its source GGUF) stay
    llama.cpp's."""
    from moedesk.app.tui.settings import Settings, save_settings
    from moedesk.engine.runtime import Engine
    from moedesk.engine.selection import not_gguf

    hub.add_repo("moe/tiny-lfm2", lfm_repo())
    for repo in ("moe/tiny", "moe/tiny-lfm2"):
        download(repo)
    download("moe/tiny-GGUF", include=["*Q4_K_M*"])

    def listed(*flags: str) -> dict[str, dict]:
        assert main(["list", "--json", *flags]) == 0
        return {m["name"]: m for m in json.loads(capsys.readouterr().out)}

    def refusal(repo: str, engine: str) -> str:
        with pytest.raises(MoedeskError) as refused:
            Engine.load(repo, engine=engine)
        return str(refused.value)

    auto = listed()
    assert auto["moe/tiny"]["engine"] == "native" and auto["moe/tiny"]["why"] == ""
    lfm = auto["moe/tiny-lfm2"]
    assert lfm["engine"] == "none" and lfm["why"].startswith("unsupported architecture 'lfm2_moe'")
    assert refusal("moe/tiny-lfm2", "auto").endswith(f": {lfm['why']}")  # the load names the folder it read

    llama = listed("--engine", "llama.cpp")
    tiny, lfm = llama["moe/tiny"], llama["moe/tiny-lfm2"]
    assert tiny["engine"] == "none" and tiny["why"] == not_gguf("llama.cpp")
    assert refusal("moe/tiny", "llama.cpp") == f"moe/tiny: {tiny['why']}"
    assert lfm["engine"] == "none" and "nor natively (unsupported architecture 'lfm2_moe'" in lfm["why"]
    assert refusal("moe/tiny-lfm2", "llama.cpp") == f"moe/tiny-lfm2: {lfm['why']}"
    assert llama["tiny:1b"]["engine"] == "llama.cpp" and llama["demo"]["engine"] == "llama.cpp"
    assert listed("--engine", "native")["moe/tiny-lfm2"]["why"] == auto["moe/tiny-lfm2"]["why"].split(", and ")[0]

    save_settings(Settings(engine="llama.cpp"))  # the app's setting is list's default
    assert listed()["moe/tiny"]["engine"] == "none"
    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    row = next(line for line in table if line.startswith("moe/tiny "))
    assert " none " in row and "qwen3_moe" in row, row
    assert f"moe/tiny: {not_gguf('llama.cpp')}" in table and f"moe/tiny-lfm2: {lfm['why']}" in table
    assert main(["list", "--engine", "auto"]) == 0
    assert "moe/tiny: " not in capsys.readouterr().out  # auto runs it natively: no line below the table


# -- rm --------------------------------------------------------------------------------------------------------

def test_rm_removes_only_that_repo_and_wants_yes_off_a_terminal(hub, capsys):
    download("moe/tiny")
    download("moe/tiny-GGUF", include=["*Q4_K_M*"])
    cache = cache_repo("moe/tiny").parent
    before = sorted(p for p in cache.rglob("*") if "moe--tiny-GGUF" in str(p))

    assert main(["rm", "moe/tiny"]) == 2  # pytest's stdin is no terminal: nothing is asked, nothing removed
    err = capsys.readouterr().err
    assert "--yes" in err.splitlines()[-1] and cache_repo("moe/tiny").is_dir()

    assert main(["rm", "moe/tiny", "--yes"]) == 0
    assert "removing moe/tiny" in capsys.readouterr().err
    assert not cache_repo("moe/tiny").exists()
    assert sorted(p for p in cache.rglob("*") if "moe--tiny-GGUF" in str(p)) == before  # the other repo intact

    assert main(["rm", "moe/tiny", "--yes"]) == 2  # gone: one line, exit 2
    assert "not in the Hugging Face cache" in one_line(capsys.readouterr().err)


def test_rm_asks_on_a_terminal_and_no_keeps_the_files(hub, capsys):
    download("moe/tiny-GGUF", include=["*Q4_K_M*"])

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    args = argparse.Namespace(name="tiny:1b", yes=False)  # a pull name names its repo
    assert mc.run_rm(args, stdin=Terminal("n\n")) == 1
    assert cache_repo("moe/tiny-GGUF").is_dir()
    assert mc.run_rm(args, stdin=Terminal("y\n")) == 0
    assert not cache_repo("moe/tiny-GGUF").exists()


def test_rm_never_touches_a_folder_outside_the_caches(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for name in (str(folder), "mine/model", "../x"):
        with pytest.raises(MoedeskError):
            mc.plan_removal(name)
    assert (folder / "config.json").is_file()


# -- ps --------------------------------------------------------------------------------------------------------

def test_ps_shows_what_a_running_server_has_loaded(tiny_checkpoint, capsys):
    key = "ps-key"
    args = ["--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32", "--context", "64",
            "--batch-size", "1", "--model-name", "tiny-moe"]
    with serve_process(args, key) as base:
        capsys.readouterr()  # the checkpoint's build
        assert main(["ps", "--url", base]) == 2  # no key: the server refuses, ps says what to do
        assert "--api-key" in one_line(capsys.readouterr().err)
        assert main(["ps", "--url", base, "--api-key", key]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == ["NAME", "FORMAT", "ARCH", "CONTEXT", "UNTIL"]
        # the name Ollama's API gives it; loaded until the server stops (no --keep-alive)
        assert row.split() == ["tiny-moe:latest", "safetensors", ARCH, "64", "forever"]


def test_ps_asks_an_openai_only_server_for_its_models(capsys):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class OpenAIOnly(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/v1/models"
            body = json.dumps({"object": "list", "data": [{"id": "some-model", "object": "model"}]} if found
                              else {"error": "not found"}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OpenAIOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert main(["ps", "--url", f"http://127.0.0.1:{server.server_port}"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().out.splitlines()[1].split() == ["some-model", "?", "?", "?", "?"]


def test_until_says_when_a_model_unloads():
    from datetime import datetime, timezone

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert mc.until("2026-01-01T00:04:30Z", now) == "in 4 minutes"
    assert mc.until("2026-01-01T00:00:01.5+00:00", now) == "in 1 second"
    assert mc.until("2027-01-01T00:00:00Z", now) == "forever"
    assert mc.until("2025-12-31T23:59:00Z", now) == "now"
    assert mc.until("yesterday", now) is None and mc.until(None, now) is None
    assert mc.until("2026-01-01T00:04:30", now) is None  # no time zone: not guessed


def test_ps_without_a_server_says_so_in_one_line(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    assert main(["ps", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert f"no server answers at http://127.0.0.1:{port}" in one_line(capsys.readouterr().err)
    for url in ("foo", "http://[::1", "ftp://x", "localhost:8000"):
        assert main(["ps", "--url", url]) == 2
        assert "not an http(s) URL" in one_line(capsys.readouterr().err), url


# -- pull ------------------------------------------------------------------------------------------------------

def test_catalogue_names_resolve_to_repos_and_quantisations():
    assert pull_catalogue.resolve("qwen3:30b-a3b") == pull_catalogue.PullTarget("unsloth/Qwen3-30B-A3B-GGUF", "Q4_K_M")
    assert pull_catalogue.resolve("Qwen3:30B-A3B:q8_0") == pull_catalogue.PullTarget("unsloth/Qwen3-30B-A3B-GGUF",
                                                                                     "q8_0")
    assert pull_catalogue.resolve("gpt-oss:20b") == pull_catalogue.PullTarget("ggml-org/gpt-oss-20b-GGUF", "MXFP4")
    assert pull_catalogue.resolve("gpt-oss:120b:safetensors").repo_id == "openai/gpt-oss-120b"
    assert pull_catalogue.resolve("qwen3.5:35b") == pull_catalogue.PullTarget("unsloth/Qwen3.5-35B-A3B-GGUF", "Q4_K_M")
    assert pull_catalogue.resolve("Qwen3.6:35B:Q8_0") == pull_catalogue.PullTarget("ggml-org/Qwen3.6-35B-A3B-GGUF",
                                                                                   "q8_0")
    for alias, name in (("qwen3:30b", "qwen3:30b-a3b"), ("Qwen3.5:35B-A3B", "qwen3.5:35b")):  # Ollama's and spelt out
        assert pull_catalogue.resolve(alias) == pull_catalogue.resolve(name)
        assert pull_catalogue.resolve(f"{alias}:q8_0") == pull_catalogue.resolve(f"{name}:q8_0")
    assert pull_catalogue.resolve("glm-4.7-flash:safetensors") == pull_catalogue.PullTarget("zai-org/GLM-4.7-Flash",
                                                                                            "safetensors")
    assert pull_catalogue.resolve("Org/Repo:q4_k_m") == pull_catalogue.PullTarget("Org/Repo", "q4_k_m")
    assert pull_catalogue.resolve("Org/Repo") == pull_catalogue.PullTarget("Org/Repo", None)
    for name, entry in pull_catalogue.CATALOGUE.items():
        assert entry.gguf_repo.count("/") == 1 and entry.safetensors_repo.count("/") == 1, name


def test_the_models_guide_lists_every_short_name_with_its_repos():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in guide.splitlines() if line.startswith("| `")}
    assert set(rows) == set(pull_catalogue.CATALOGUE)
    for name, entry in pull_catalogue.CATALOGUE.items():
        row = rows[name]
        assert entry.gguf_repo in row and f"`{entry.default_tag.lower()}`" in row and entry.safetensors_repo in row


def test_pull_of_an_unknown_short_name_is_one_line_and_exit_2(capsys):
    assert main(["pull", "llama9:1b"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "llama9:1b" in line and "qwen3:30b-a3b" in line


def test_pull_resolves_a_short_name_and_resumes_an_interrupted_download(hub, capsys):
    repo = hub.repos["moe/tiny-GGUF"]
    data = repo.files["tiny-Q4_K_M.gguf"]
    # What an interrupted pull leaves: the first 70,000 bytes in the partial blob that the next one continues.
    partial = cache_repo("moe/tiny-GGUF") / "blobs" / f"{repo.sha256('tiny-Q4_K_M.gguf')}.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:70_000])

    assert main(["pull", "tiny:1b"]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == data
    assert [r.range for r in hub.gets("moe/tiny-GGUF", "tiny-Q4_K_M.gguf")] == ["bytes=70000-"]
    assert not hub.gets("moe/tiny-GGUF", "tiny-Q8_0.gguf")  # only the quantisation asked for
    assert "GGUF Q4_K_M (1 file" in err and "to download" in err and "RAM:" in err
    assert "once loaded: ~" in err  # from the GGUF's header, read from the Hub before downloading

    assert main(["pull", "tiny:1b:q8_0"]) == 0
    assert Path(capsys.readouterr().out.strip()).name == "tiny-Q8_0.gguf"


def test_a_pulled_short_name_is_what_model_loads(hub, capsys, tmp_path, monkeypatch):
    # Before the pull: one line that says how to get it, for every command that takes --model.
    for command in (["batch", "in.jsonl", "-o", "out.jsonl"], ["profile"], ["serve"]):
        assert main([*command, "--model", "tiny:1b"]) == 2, command
        assert one_line(capsys.readouterr().err) == (
            "moedesk: tiny:1b is not on this computer yet: `moedesk pull tiny:1b` downloads it")
    assert main(["pull", "tiny:1b"]) == 0
    pulled = capsys.readouterr().out.strip()
    assert pull_catalogue.local_model("tiny:1b") == pulled == pull_catalogue.local_model("TINY:1B:q4_k_m")
    with pytest.raises(MoedeskError, match="tiny:1b:q8_0 is not on this computer yet"):
        pull_catalogue.local_model("tiny:1b:q8_0")  # the repo is there, that quantisation is not
    with pytest.raises(MoedeskError, match="tiny:1b:safetensors is not on this computer yet"):
        pull_catalogue.local_model("tiny:1b:safetensors")
    assert main(["pull", "tiny:1b:safetensors"]) == 0
    assert pull_catalogue.local_model("tiny:1b:safetensors") == capsys.readouterr().out.strip() == "moe/tiny"
    # Anything else is left to the loader as typed: paths, repo ids, other names; a folder of that name wins.
    for other in ("demo", "moe/tiny-GGUF", "llama9:1b", str(tmp_path)):
        assert pull_catalogue.local_model(other) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny:1b").mkdir()
    assert pull_catalogue.local_model("tiny:1b") is None


def test_pull_shows_the_memory_estimate_before_downloading_safetensors(hub, tiny_checkpoint, capsys, monkeypatch):
    import torch

    from moedesk.app.download import format_bytes
    from moedesk.engine.load.size_estimate import summarize_path

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the estimate for a CPU, on any machine

    assert main(["pull", "tiny:1b:safetensors"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "moe/tiny"
    # the wizard's estimate, from the Hub's headers: what the same files on disk give (CPU: float32 weights)
    local = summarize_path(tiny_checkpoint(ARCH)).estimate("auto", "float32")
    lines = err.splitlines()
    estimate = lines[lines.index(next(l for l in lines if l.startswith("once loaded:")))]
    assert f"~{format_bytes(local.total_bytes)} in RAM" in estimate and "f32 weights" in estimate
    assert estimate_comes_before_download(lines)


def estimate_comes_before_download(lines: list[str]) -> bool:
    first = lambda prefix: next(i for i, line in enumerate(lines) if prefix in line)  # noqa: E731
    return first("once loaded:") < first("done: run it with")


def test_pull_of_a_tag_the_repo_lacks_names_the_tags_it_has(hub, capsys):
    assert main(["pull", "tiny:1b:q2_k"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "q4_k_m" in line and "q8_0" in line


def test_rm_demo_removes_its_build_but_never_follows_a_link_out_of_the_cache(tmp_path, monkeypatch, capsys):
    from moedesk.app.tui.catalog import demo_folder

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"x" * 1000)
    demo_folder().parent.mkdir(parents=True)
    demo_folder().symlink_to(elsewhere, target_is_directory=True)
    assert main(["rm", "demo", "--yes"]) == 2
    assert "outside moedesk's cache" in capsys.readouterr().err
    assert (elsewhere / "model.safetensors").is_file()

    demo_folder().unlink()
    demo_folder().mkdir()
    (demo_folder() / "config.json").write_text("{}")
    assert main(["rm", "demo", "--yes"]) == 0
    assert not demo_folder().exists() and demo_folder().parent.is_dir()


def test_rm_takes_a_repos_partial_downloads_too(hub):
    download("moe/tiny-GGUF", include=["*Q4_K_M*"])
    partial = cache_repo("moe/tiny-GGUF") / "blobs" / f"{'0' * 64}.incomplete"
    partial.write_bytes(b"half a file")
    assert main(["rm", "moe/tiny-GGUF", "--yes"]) == 0
    assert not cache_repo("moe/tiny-GGUF").exists()
