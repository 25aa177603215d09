"""The model registry's decisions (app/model_registry.py), without loading anything: keep-alive, which model
blocks or is unloaded, whether one fits, and the pool applying them with a fake loader and clock."""
import asyncio

import pytest

from moedesk.app.model_registry import (UNSET, Entry, ModelBusy, ModelPool, NoRoom, blocker, expired, expires_in,
                                        keep_alive_of, parse_keep_alive, room_refusal, to_unload)

GIB = 2**30


@pytest.mark.parametrize("text, seconds", [("5m", 300), ("30s", 30), ("1h", 3600), ("90", 90), ("0", 0),
                                           ("-1", None), ("-5m", None), ("1.5m", 90), ("1h30m", 5400),
                                           ("250ms", 0.25), (300, 300), (2.5, 2.5), (0, 0), (-1, None)])
def test_keep_alive_durations(text, seconds):
    assert parse_keep_alive(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5 minutes", "m", "5d", "1h 30m", "--5m", True, None, [5],
                                  float("nan"), float("inf")])
def test_keep_alive_refuses_what_is_no_duration(text):
    with pytest.raises(ValueError, match="is no duration"):
        parse_keep_alive(text)


def test_a_requests_keep_alive_wins_over_the_servers_until_the_next_request():
    entry = Entry("a", "a", engine="A", last_used=100.0)
    assert keep_alive_of(entry, 300.0) == 300.0 and expires_in(entry, 110.0, 300.0) == 290.0
    entry.keep_alive = 60.0
    assert keep_alive_of(entry, 300.0) == 60.0 and expires_in(entry, 110.0, 300.0) == 50.0
    assert expires_in(entry, 1000.0, 300.0) == 0.0
    entry.keep_alive = None  # a negative keep_alive: never
    assert keep_alive_of(entry, 0.0) is None and expires_in(entry, 1e9, 0.0) is None
    entry.keep_alive = UNSET
    assert expires_in(entry, 1e9, None) is None
    entry.busy = 1  # in use: no expiry yet
    assert expires_in(entry, 110.0, 300.0) is None


def test_one_model_on_the_gpu_at_a_time():
    a, b, c = Entry("a", "a", engine="A"), Entry("b", "b"), Entry("c", "c")
    assert to_unload([a, b, c], b) == [a] and to_unload([a, b, c], a) == []
    assert blocker([a, b, c], b) is None
    a.busy = 2
    assert blocker([a, b, c], b) is a and blocker([a, b, c], a) is None


def test_idle_models_expire_after_their_keep_alive_only():
    entry = Entry("a", "a", engine="A", last_used=100.0)
    assert not expired(entry, 104.0, 5) and expired(entry, 105.0, 5) and expired(entry, 100.0, 0)
    assert not expired(entry, 1e9, None)  # -1: never
    entry.busy = 1
    assert not expired(entry, 1e9, 0)
    assert not expired(Entry("b", "b", engine="B", reloadable=False), 1e9, 0)  # handed in: cannot be loaded again
    assert not expired(Entry("c", "c"), 1e9, 0)  # not loaded


def test_room_is_the_estimate_against_available_ram_with_headroom():
    assert room_refusal("m", None, GIB) is None  # no estimate: the load checks for itself
    assert room_refusal("m", GIB // 2, GIB) is None
    reason = room_refusal("m", GIB, GIB)  # 10% headroom stays free
    assert "'m' needs 1.0 GiB of RAM" in reason and "1.0 GiB is available" in reason and "\n" not in reason


class FakeEngine:
    def __init__(self, source):
        self.source, self.closed = source, False

    def close(self):
        self.closed = True

    def retry_after(self):
        return 3


def pool(**options):
    loads = []

    def load(source):
        loads.append(source)
        return FakeEngine(source), "group"

    now = [0.0]
    models = ModelPool([Entry("a", "src-a"), Entry("b", "src-b")], load=load, clock=lambda: now[0],
                       locate=lambda name: f"cache/{name}" if name == "cached" else None, **options)
    return models, loads, now


def test_pool_loads_on_first_use_and_swaps_only_idle_models():
    async def run():
        models, loads, _ = pool()
        a, b = models.find("a"), models.find("b:latest")  # Ollama's tag names the same model
        assert (a.name, b.name) == ("a", "b") and models.find("nope") is None
        await models.acquire(a)
        await models.acquire(a)
        assert loads == ["src-a"] and a.busy == 2 and models.current is a
        with pytest.raises(ModelBusy, match="'b' cannot load while 'a' is answering 2 requests"):
            await models.acquire(b)
        models.release(a)
        models.release(a)
        first = a.engine
        await models.acquire(b)
        assert loads == ["src-a", "src-b"] and first.closed and not a.loaded and models.current is b
        cached = models.find("cached")
        assert cached.source == "cache/cached" and models.entries[-1] is cached
    asyncio.run(run())


def test_pool_refuses_a_model_too_big_for_the_ram_before_loading_it():
    async def run():
        models, loads, _ = pool(need=lambda source: 8 * GIB if source == "src-b" else GIB, available=lambda: 4 * GIB)
        await models.acquire(models.find("a"))
        models.release(models.find("a"))
        with pytest.raises(NoRoom, match="'b' needs 8.0 GiB .* 5.0 GiB is available"):  # a's 1 GiB counted free
            await models.acquire(models.find("b"))
        assert loads == ["src-a"] and models.current.name == "a"  # refused before a was unloaded
    asyncio.run(run())


def test_keep_alive_zero_unloads_after_each_request():
    async def run():
        models, loads, _ = pool(keep_alive=0)
        a = await models.acquire(models.find("a"))
        engine = a.engine
        models.release(a)
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not a.loaded and engine.closed
    asyncio.run(run())


def test_a_request_in_time_keeps_the_model_loaded():
    async def run():
        models, _, now = pool(keep_alive=0.05)
        a = await models.acquire(models.find("a"))
        models.release(a)
        await models.acquire(a)  # back before the keep-alive: the timer is cancelled
        now[0] = 10.0
        await asyncio.sleep(0.1)
        assert a.loaded
        models.release(a)
        now[0] = 20.0  # its keep-alive passes
        await asyncio.sleep(0.1)
        assert not a.loaded
    asyncio.run(run())
