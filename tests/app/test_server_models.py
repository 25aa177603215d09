"""Several models behind one `moedesk serve`: two tiny random checkpoints (tests/tiny_models.py) served by name, each
answering with its own greedy text (checked against a server of that model alone); the list says which is loaded;
keep-alive 0 unloads; a model too big for a faked small RAM gets 503; an unknown name 404, in OpenAI's shape and
Ollama's. A real uvicorn server and the official openai client."""
import gc
import shutil
import time
import weakref

import httpx
import openai
import pytest

from moedesk.app.cli import build_parser, serve_pool
from moedesk.app.model_registry import Entry, ModelPool
from moedesk.engine.interface import Group
from moedesk.engine.load.size_estimate import summarize_path
from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.app.test_server import running_server

KEY = "sk-models"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"alpha": str(tiny_models.build("qwen3_moe", root / "alpha", seed=1)),
            "beta": str(tiny_models.build("olmoe", root / "beta", seed=2))}


def load(source):
    return Engine.load(source, device="cpu", dtype="float32"), Group(4)


def reference(folder) -> str:
    """The greedy reply of a server of this model alone (the path every single-model test checks)."""
    engine = Engine.load(folder, device="cpu", dtype="float32")
    with running_server(engine, api_key=KEY, model_name="solo") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        reply = client.chat.completions.create(model="solo", messages=ASK, max_tokens=8, temperature=0)
    engine.scheduler.close()
    return reply.choices[0].message.content


def served(folders, loader=load, **options):
    pool = ModelPool([Entry(name, folder) for name, folder in folders.items()], load=loader, **options)
    return running_server(None, api_key=KEY, models=pool), pool


def loaded(base) -> dict:
    return {m["id"]: m["loaded"] for m in httpx.get(base + "/v1/models", headers=AUTH).json()["data"]}


def test_each_model_answers_by_name_with_its_own_text(folders):
    expected = {name: reference(folder) for name, folder in folders.items()}
    assert expected["alpha"] != expected["beta"]
    server, pool = served(folders)
    with server as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert {m.id for m in client.models.list()} == {"alpha", "beta"}
        assert loaded(base) == {"alpha": False, "beta": False}  # loads on first use
        for name in ("alpha", "beta", "alpha"):
            reply = client.chat.completions.create(model=name, messages=ASK, max_tokens=8, temperature=0)
            assert reply.model == name and reply.choices[0].message.content == expected[name]
            assert loaded(base) == {"alpha": name == "alpha", "beta": name == "beta"}  # one at a time
        streamed = client.chat.completions.create(model="beta", messages=ASK, max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected["beta"]
        ps = httpx.get(base + "/api/ps", headers=AUTH).json()["models"]
        assert [m["model"] for m in ps] == ["beta:latest"]
        tags = httpx.get(base + "/api/tags", headers=AUTH).json()["models"]
        assert sorted(m["model"] for m in tags) == ["alpha:latest", "beta:latest"]
        ollama = httpx.post(base + "/api/chat", headers=AUTH, json={
            "model": "alpha", "messages": ASK, "stream": False, "options": {"temperature": 0, "num_predict": 8}})
        assert ollama.json()["message"]["content"] == expected["alpha"] and loaded(base)["alpha"]


def test_unknown_model_is_404_in_openai_and_ollama_shapes(folders):
    server, _ = served(folders)
    with server as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="gamma", messages=ASK, max_tokens=2)
        assert caught.value.body["code"] == "model_not_found" and "'gamma'" in caught.value.body["message"]
        assert httpx.get(base + "/v1/models/gamma", headers=AUTH).status_code == 404
        assert httpx.get(base + "/v1/models/beta", headers=AUTH).json() == {**_card("beta"), "created": _created(base)}
        answer = httpx.post(base + "/api/chat", headers=AUTH, json={"model": "gamma", "messages": ASK})
        assert answer.status_code == 404 and "model 'gamma' not found" in answer.json()["error"]
        assert loaded(base) == {"alpha": False, "beta": False}


def test_another_model_is_503_with_retry_after_while_the_loaded_one_answers(folders):
    """A request for a model other than the loaded one, while that one still answers, is refused at once (503
    model_busy with a Retry-After, in OpenAI's and Ollama's shapes) rather than queued; once it is idle, it loads."""
    server, _ = served(folders)
    long_reply = {"model": "alpha", "messages": ASK, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                  "stream": True}
    with server as base:
        with httpx.stream("POST", base + "/v1/chat/completions", json=long_reply, headers=AUTH, timeout=120) as r:
            lines = r.iter_lines()  # held: a closed iterator would close the stream, and alpha's request with it
            next(line for line in lines if line.startswith("data: {"))  # alpha is answering
            refused = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=60,
                                 json={"model": "beta", "messages": ASK, "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_busy", refused.text
            assert int(refused.headers["retry-after"]) >= 1 and "'alpha'" in refused.json()["error"]["message"]
            ollama = httpx.post(base + "/api/chat", headers=AUTH, timeout=60, json={"model": "beta", "messages": ASK})
            assert ollama.status_code == 503 and "alpha" in ollama.json()["error"]
            assert loaded(base) == {"alpha": True, "beta": False}
        for _ in range(200):  # the disconnected stream frees alpha at its next step
            answer = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=120,
                                json={"model": "beta", "messages": ASK, "max_tokens": 2})
            if answer.status_code != 503:
                break
            time.sleep(0.1)
        assert answer.status_code == 200 and loaded(base) == {"alpha": False, "beta": True}


def _card(name):
    return {"id": name, "object": "model", "owned_by": "moedesk", "loaded": False}


def _created(base):
    return httpx.get(base + "/v1/models", headers=AUTH).json()["data"][0]["created"]


def test_keep_alive_zero_unloads_after_each_request(folders):
    engines = []

    def loading(source):  # the engines it loads, watched: unloaded, nothing may keep one alive
        engine, group = load(source)
        engines.append(weakref.ref(engine))
        return engine, group

    server, pool = served(folders, loading, keep_alive=0)
    with server as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        client.completions.create(model="alpha", prompt="The quick brown", max_tokens=4, temperature=0)
        for _ in range(100):
            if not loaded(base)["alpha"]:
                break
            time.sleep(0.05)
        assert loaded(base) == {"alpha": False, "beta": False}
        assert httpx.get(base + "/api/ps", headers=AUTH).json()["models"] == []
        list(client.chat.completions.create(model="beta", messages=ASK, max_tokens=4, stream=True))
        for _ in range(100):
            if not loaded(base)["beta"]:
                break
            time.sleep(0.05)
        gc.collect()
        assert len(engines) == 2 and all(ref() is None for ref in engines)  # their memory is free


def test_a_model_too_big_for_the_ram_is_refused_with_503(folders):
    def need(source):  # the weights' real estimate, as serve computes it
        return summarize_path(source).estimate("auto", "float32").ram_bytes(False)

    alpha, beta = need(folders["alpha"]), need(folders["beta"])
    assert alpha < beta
    free = [int(beta / 0.9) - 1]  # a tenth stays free: beta does not fit
    server, pool = served(folders, need=need, available=lambda: free[0])
    with server as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model="alpha", prompt="Hi", max_tokens=2).choices[0].text is not None
        free[0] -= alpha  # alpha's weights are in RAM now; unloading it would give them back
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="beta", messages=ASK, max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "insufficient_memory"
        assert "'beta' needs" in caught.value.body["message"] and "rather than swap" in caught.value.body["message"]
        assert loaded(base) == {"alpha": True, "beta": False}  # refused before anything was unloaded
        answer = httpx.post(base + "/api/generate", headers=AUTH, json={"model": "beta", "prompt": "Hi"})
        assert answer.status_code == 503 and "'beta' needs" in answer.json()["error"]


def test_serve_finds_models_in_the_local_caches_and_checks_its_flags(folders, tmp_path, monkeypatch):
    import huggingface_hub.constants

    own, hub = tmp_path / "own-models", tmp_path / "hub"
    own.mkdir()
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(own))
    (own / "own").symlink_to(folders["beta"])
    (own / "notes").mkdir()  # no model: not listed
    for i in (1, 2):  # a split GGUF's parts: one model, named by its first part
        (own / f"split-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    repo = hub / "models--org--tiny"  # the local Hugging Face cache's layout
    shutil.copytree(folders["alpha"], repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    args = build_parser().parse_args(["serve", "--model", folders["alpha"], "--model-name", "alpha",
                                      "--keep-alive", "5m", "--device", "cpu"])
    pool = serve_pool(args, args.model, load, 300)
    assert [e.name for e in pool.entries] == ["alpha"] and pool.keep_alive == 300
    assert [(e.name, e.source, e.loaded) for e in pool.listing()] == [
        ("alpha", folders["alpha"], False), ("own", str(own / "own"), False),
        ("split-00001-of-00002.gguf", str(own / "split-00001-of-00002.gguf"), False), ("org/tiny", "org/tiny", False)]
    assert pool.find("own").source == str(own / "own")  # moedesk's own models folder
    assert pool.find(folders["beta"]).source == folders["beta"]  # any path --model takes
    assert pool.find("nobody/nothing") is None and pool.find("no-such-model") is None
    assert pool.need(folders["beta"]) == summarize_path(folders["beta"]).estimate("auto", "float32").ram_bytes(False)


def test_serve_names_a_pulled_short_name_by_that_name_and_finds_others_pulled(folders, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from moedesk.app import pull_catalogue
    from moedesk.app.cli import model_specs

    hub = tmp_path / "hub"
    for repo, quant in (("org/tiny-GGUF", "Q4_K_M"), ("org/other-GGUF", "Q8_0")):  # what `moedesk pull` leaves
        folder = hub / f"models--{repo.replace('/', '--')}"
        (folder / "snapshots" / "abc123").mkdir(parents=True)
        shutil.copy(tiny_gguf(tmp_path), folder / "snapshots" / "abc123" / f"tiny-{quant}.gguf")
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "no-models"))
    for name, repo, quant in (("tiny:1b", "org/tiny-GGUF", "Q4_K_M"), ("other:2b", "org/other-GGUF", "Q8_0")):
        monkeypatch.setitem(pull_catalogue.CATALOGUE, name, pull_catalogue.CatalogueEntry(repo, quant, "org/x", ""))
    args = build_parser().parse_args(["serve", "--model", "tiny:1b", "--device", "cpu"])
    model_specs(args)
    pulled = str(hub / "models--org--tiny-GGUF" / "snapshots" / "abc123" / "tiny-Q4_K_M.gguf")
    assert args.model == [pulled]
    pool = serve_pool(args, args.model, load, 300)
    assert [(e.name, e.source) for e in pool.entries] == [("tiny:1b", pulled)]
    other = pool.find("other:2b:latest")  # pulled, not given to --model: found as Ollama finds what it pulled
    assert other.name == "other:2b" and other.source.endswith("models--org--other-GGUF/snapshots/abc123/tiny-Q8_0.gguf")
    assert pool.find("tiny:1b:q8_0") is None  # that quantisation was not pulled


def tiny_gguf(tmp_path):
    from tests.load.test_gguf_header import write_moe_gguf

    return write_moe_gguf(tmp_path / "tiny.gguf", layers=(("q8_0", "q8_0"),), H=256, F=256)[0]


def test_moedesk_serve_with_two_models_as_users_start_it(folders):
    """`moedesk serve --model A --model B --keep-alive 0` in a subprocess: the first loads at start and stays
    until used, the second on its first request, then each unloads after its request."""
    from tests.app.serve_process import serve_process

    args = ["--model", folders["alpha"], "--model-name", "alpha", "--model", folders["beta"], "--keep-alive", "0",
            "--device", "cpu", "--dtype", "float32", "--batch-size", "2"]
    with serve_process(args, KEY) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert {m.id: m.model_extra["loaded"] for m in client.models.list()} == {"alpha": True, folders["beta"]: False}
        reply = client.chat.completions.create(model=folders["beta"], messages=ASK, max_tokens=4, temperature=0)
        assert reply.model == folders["beta"] and reply.usage.completion_tokens >= 1
        deadline = time.monotonic() + 20
        while any(loaded(base).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loaded(base) == {"alpha": False, folders["beta"]: False}


@pytest.mark.parametrize("flags, message", [
    (["--keep-alive", "soon"], "moedesk: --keep-alive: 'soon' is no duration: give one such as 5m"),
    (["--model", "demo", "--model", "demo"], "moedesk: --model: demo given twice"),
    (["--model", "demo", "--model", "x", "--speculative", "greedy"], "moedesk: --speculative and --draft serve one"),
])
def test_serve_refuses_bad_model_flags_in_one_line_before_loading(flags, message, capsys):
    from moedesk.app.cli import main

    assert main(["serve", *flags, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def _unloaded(base, name) -> bool:
    for _ in range(200):
        if not loaded(base)[name]:
            return True
        time.sleep(0.05)
    return False


def test_ollama_keep_alive_per_request_with_the_official_client(folders):
    ollama = pytest.importorskip("ollama")  # the test extras install it
    from datetime import datetime, timezone

    server, pool = served(folders)  # the server's own keep-alive: never
    short = {"num_predict": 2, "temperature": 0}
    with server as base:
        local = ollama.Client(host=base, headers=AUTH, timeout=120)

        def left(name) -> float:  # seconds until /api/ps says it unloads
            [model] = [m for m in local.ps().models if m.model == name]
            return (model.expires_at - datetime.now(timezone.utc)).total_seconds()

        local.chat(model="alpha", messages=ASK, options=short, keep_alive="10m")
        assert 590 < left("alpha:latest") <= 600
        local.generate(model="alpha", prompt="Hi", options=short, keep_alive=-1)  # negative: never
        assert left("alpha:latest") > 300 * 86400
        local.generate(model="alpha", prompt="Hi", options=short)  # none given: the server's, never
        assert left("alpha:latest") > 300 * 86400
        local.generate(model="alpha", prompt="Hi", options=short, keep_alive=0)  # 0: unloaded after this request
        assert _unloaded(base, "alpha") and local.ps().models == []

        # A number is seconds; streamed chat as well as plain.
        assert list(local.chat(model="beta", messages=ASK, options=short, stream=True, keep_alive=1.5))[-1].done
        assert 0 < left("beta:latest") <= 1.5
        assert _unloaded(base, "beta")

        # Ollama's load and `ollama stop`: nothing to generate, keep_alive 0 unloads at once.
        assert local.generate(model="beta", keep_alive="1h30m").done_reason == "load"
        assert 5390 < left("beta:latest") <= 5400 and loaded(base) == {"alpha": False, "beta": True}
        assert local.generate(model="beta", keep_alive=0).done_reason == "unload"
        assert loaded(base) == {"alpha": False, "beta": False}
        assert local.chat(model="alpha", messages=[], keep_alive="5m").done_reason == "load"
        assert loaded(base)["alpha"]

        with pytest.raises(ollama.ResponseError) as caught:
            local.chat(model="alpha", messages=ASK, options=short, keep_alive="soon")
        assert caught.value.status_code == 400 and "keep_alive" in caught.value.error
