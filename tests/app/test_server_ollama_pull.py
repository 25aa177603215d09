"""Ollama's /api/pull and /api/delete on `moedesk serve`, driven by the official ollama client against a fake Hub on
127.0.0.1: progress lines then success, the files in the Hugging Face cache, a resumed pull, removal, and the errors
an unknown name, tag or model give."""
import pytest

from tests.app.test_download import GGUF_ONLY, hub  # noqa: F401 -- hub: the fake Hub fixture
from tests.app.test_server import KEY, engine, running_server  # noqa: F401 -- engine: the module's fixture

ollama = pytest.importorskip("ollama")  # the test extras install it
PULL_ROUTES = [("POST", "/api/pull"), ("DELETE", "/api/delete")]


@pytest.fixture(scope="module")
def base(engine):  # noqa: F811
    with running_server(engine, api_key=KEY, model_name="tiny") as url:
        yield url


@pytest.fixture
def client(base):
    return ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def cached(hub):  # noqa: F811
    from moedesk.app.download import hf_cache_dir

    return sorted(p.name for p in hf_cache_dir().glob("models--moe--gguf-only/snapshots/*/*"))


def test_a_pull_streams_progress_then_success_and_the_model_is_in_the_cache(client, hub):  # noqa: F811
    lines = list(client.pull("moe/gguf-only:q6_k", stream=True))
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    progress = [p for p in lines if p.total]
    assert progress and progress[-1].completed == progress[-1].total == len(GGUF_ONLY["m-Q6_K.gguf"])
    assert all(p.status == "pulling Q6_K" and p.digest.startswith("moe/gguf-only@") for p in progress)
    assert cached(hub) == ["m-Q6_K.gguf"]
    # pulled again: nothing to fetch, the whole size already there at the first progress line
    again = list(client.pull("moe/gguf-only:q6_k", stream=True))
    assert again[-1].status == "success" and [p.completed for p in again if p.total][0] == progress[-1].total
    assert client.pull("moe/gguf-only:q4_k_m").status == "success"  # not streamed: the last line only
    assert cached(hub) == ["m-Q4_K_M.gguf", "m-Q6_K.gguf"]


def test_delete_removes_a_pulled_model_and_a_second_delete_is_a_404(client, hub):  # noqa: F811
    client.pull("moe/gguf-only:q6_k")
    assert client.delete("moe/gguf-only").status == "success"
    assert cached(hub) == []
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("moe/gguf-only")
    assert e.value.status_code == 404 and "not found" in e.value.error


@pytest.mark.parametrize("name, status, words", [
    ("no-such-model", 400, "no-such-model"),
    ("moe/gguf-only:q2_k", 500, "no such choice; its tags: q4_k_m, q6_k"),
    ("moe/missing:q4_k_m", 500, "moe/missing"),
])
def test_a_pull_that_cannot_run_says_why(client, hub, name, status, words):  # noqa: F811
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(name)
    assert e.value.status_code == status and words in e.value.error


def test_the_model_the_server_has_loaded_is_not_deleted_from_under_it(client, engine, hub):  # noqa: F811
    from starlette.testclient import TestClient

    from moedesk.app.download import hf_cache_dir
    from moedesk.app.server import Server

    client.pull("moe/gguf-only:q6_k")
    [gguf] = hf_cache_dir().glob("models--moe--gguf-only/snapshots/*/m-Q6_K.gguf")
    server = Server(engine, model_name="tiny")
    server.pool.entries[0].source = str(gguf)  # as a pool that loaded the pulled file has it
    r = TestClient(server.app).request("DELETE", "/api/delete", json={"model": "moe/gguf-only"})
    assert r.status_code == 409 and "is loaded as 'tiny'" in r.json()["error"]
    assert cached(hub) == ["m-Q6_K.gguf"]


@pytest.mark.parametrize("method, path", PULL_ROUTES)
def test_pull_and_delete_ask_for_the_key_and_cap_the_body(base, method, path):
    import httpx

    from moedesk.app.server import MAX_BODY_BYTES

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.request(method, base + path, json={"model": "moe/x"}, headers=headers).status_code == 401
    big = httpx.request(method, base + path, content=b" " * (MAX_BODY_BYTES + 1),
                        headers={"Authorization": f"Bearer {KEY}"})
    assert big.status_code == 413
