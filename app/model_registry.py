"""The models one `moedesk serve` answers for: which is loaded, which to unload, whether the next one fits.

One model's experts on the GPU at a time: loading another first unloads the idle one; while the loaded one still
has requests in flight, a request for another is refused (ModelBusy: 503 with Retry-After) rather than queued
behind an unknown amount of work. A model loads on first use, after its weights' size estimate is checked against
the RAM available (NoRoom: 503), and unloads after `keep_alive` seconds idle (0: after each request; None: never):
the server's, or the one the model's latest request gave (Ollama's per-request `keep_alive`).

The decisions are pure functions (tests/app/test_model_registry.py); `ModelPool` applies them, with the loading,
the memory figures and the clock handed in.
"""
from __future__ import annotations

import asyncio
import gc
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from moedesk.engine.memory_fit import gib, usable

_UNITS = {"": 1, "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a request that gives no keep_alive: the server's applies


def parse_keep_alive(value) -> float | None:
    """Seconds a model stays loaded while idle, from a flag or an Ollama request's keep_alive: a number of seconds
    (JSON number or text: '90'), a duration ('5m', '30s', '1h', '1h30m', '500ms', as Ollama's Go durations), 0
    (unload after each request), anything negative (never: None). ValueError (one line) otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = value.strip() if isinstance(value, str) else None
        sign, body = (-1, text[1:]) if text and text.startswith("-") else (1, text)
        if body and re.fullmatch(r"\d+(?:\.\d+)?", body):
            seconds = sign * float(body)
        elif body and _DURATION.sub("", body) == "" and re.fullmatch(r"(?:\d+(?:\.\d+)?[a-zµ]+)+", body):
            seconds = sign * sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(body))
        else:
            raise ValueError(f"{value!r} is no duration: give one such as 5m, 30s, 1h, 0 (unload after each "
                             f"request) or -1 (never unload)")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"{value!r} is no duration: give a finite number of seconds")
    return None if seconds < 0 else seconds


@dataclass(eq=False)
class Entry:
    """One servable model: the id clients send, what `--model` would name for it, and its state."""

    name: str
    source: str
    engine: object = None  # loaded: the EngineFace; None while unloaded
    group: object = None  # the scheduler Group its requests decode in (made at load, sized for its KV caches)
    busy: int = 0  # requests in flight
    last_used: float = 0.0
    reloadable: bool = True  # False: an engine handed in, which this pool cannot load again once dropped
    expiry: object = field(default=None, repr=False)  # the pending idle-unload timer
    keep_alive: object = UNSET  # its latest request's keep-alive (seconds, None: never), else the server's

    @property
    def loaded(self) -> bool:
        return self.engine is not None


class ModelBusy(Exception):
    """Another model is loaded and still has requests in flight."""

    def __init__(self, wanted: str, holder: Entry):
        super().__init__(f"'{wanted}' cannot load while '{holder.name}' is answering {holder.busy} "
                         f"request{'s' if holder.busy != 1 else ''} (one model at a time); retry when it is idle")
        self.holder = holder


class NoRoom(Exception):
    """The model's weights do not fit the RAM available."""


# --- pure decisions ------------------------------------------------------------------------------------------

def blocker(entries, wanted: Entry) -> Entry | None:
    """The loaded model (other than `wanted`) that cannot be unloaded now because it is busy, if any."""
    return next((e for e in entries if e is not wanted and e.loaded and e.busy), None)


def to_unload(entries, wanted: Entry) -> list[Entry]:
    """The models to unload before `wanted` loads: every other loaded one (their experts hold the GPU)."""
    return [e for e in entries if e is not wanted and e.loaded]


def keep_alive_of(entry: Entry, default: float | None) -> float | None:
    """How long `entry` stays loaded once idle: what its latest request asked, else the server's `--keep-alive`."""
    return default if entry.keep_alive is UNSET else entry.keep_alive


def expires_in(entry: Entry, now: float, default: float | None) -> float | None:
    """Seconds until a loaded `entry` unloads (None: not while it is busy, nor ever for a keep-alive of None or a
    model the pool could not load again)."""
    keep_alive = keep_alive_of(entry, default)
    if keep_alive is None or entry.busy or not entry.reloadable:
        return None
    return max(0.0, keep_alive - (now - entry.last_used))


def expired(entry: Entry, now: float, keep_alive: float | None) -> bool:
    """Whether an idle loaded model has outlived its keep-alive (never, for one the pool could not load again)."""
    return entry.loaded and not entry.busy and entry.reloadable and keep_alive is not None \
        and now - entry.last_used >= keep_alive


def room_refusal(name: str, need: int | None, available: int) -> str | None:
    """Why `name` (needing `need` bytes of RAM; None: unknown) must not load with `available` free, or None."""
    if need is None or need <= usable(available):
        return None
    return f"'{name}' needs {gib(need)} of RAM once loaded and {gib(available)} is available; not loaded, rather " \
           f"than swap"


# --- the pool -----------------------------------------------------------------------------------------------

class ModelPool:
    """The server's models. `load(source)` -> (engine, Group) loads one (on a worker thread); `need(source)` -> its
    RAM in bytes or None; `available()` -> RAM available now; `locate(name)` -> the source of a model found in the
    local caches, or None; `discover()` -> the names of the models the local caches hold."""

    def __init__(self, entries: list[Entry], *, load: Callable | None = None, keep_alive: float | None = None,
                 need: Callable = lambda source: None, available: Callable | None = None,
                 locate: Callable = lambda name: None, discover: Callable = lambda: (),
                 clock: Callable = time.monotonic):
        self.entries = list(entries)
        self.load, self.keep_alive, self.need, self.locate, self.clock = load, keep_alive, need, locate, clock
        self.discover = discover
        self.available = available or _available_ram
        self._lock = asyncio.Lock()

    @classmethod
    def of_engine(cls, engine, name: str, group) -> "ModelPool":
        """A pool of one engine already loaded by the caller: never unloaded."""
        return cls([Entry(name, name, engine, group, reloadable=False)])

    @property
    def current(self) -> Entry | None:
        return next((e for e in self.entries if e.loaded), None)

    def find(self, name: str) -> Entry | None:
        """The entry clients call `name` (Ollama's ':latest' tag ignored), added if the local caches hold it."""
        for candidate in (name, name.removesuffix(":latest")):
            entry = next((e for e in self.entries if e.name == candidate), None)
            if entry is not None:
                return entry
        if self.load is None:
            return None
        source = self.locate(name.removesuffix(":latest"))
        if source is None:
            return None
        entry = Entry(name.removesuffix(":latest"), source)
        self.entries.append(entry)
        return entry

    def listing(self) -> list[Entry]:
        """The served models, then the others the local caches hold (the list clients choose from)."""
        if self.load is not None:
            for name in self.discover():
                self.find(name)
        return self.entries

    async def acquire(self, entry: Entry) -> Entry:
        """Mark a request in flight on `entry`, loading it first if need be (ModelBusy, NoRoom)."""
        async with self._lock:
            if not entry.loaded:
                holder = blocker(self.entries, entry)
                if holder is not None:
                    raise ModelBusy(entry.name, holder)
                unload = to_unload(self.entries, entry)
                for other in unload:
                    if not other.reloadable:
                        raise ModelBusy(entry.name, other)
                # Refused before the loaded model is dropped: counting the RAM its unloading would free
                need = await asyncio.to_thread(self.need, entry.source)
                freed = sum(await asyncio.to_thread(lambda: [self.need(o.source) or 0 for o in unload]))
                reason = room_refusal(entry.name, need, self.available() + freed)
                if reason is not None:
                    raise NoRoom(reason)
                for other in unload:
                    await asyncio.to_thread(self._drop, other)
                entry.engine, entry.group = await asyncio.to_thread(self.load, entry.source)
            entry.busy += 1
            _cancel(entry)
            return entry

    def release(self, entry: Entry, keep_alive=UNSET) -> None:
        """A request on `entry` is over: once it is idle, unload it after the keep-alive (the request's own, in
        seconds or None for never; UNSET: the server's)."""
        entry.busy -= 1
        entry.last_used = self.clock()
        entry.keep_alive = keep_alive
        wait = keep_alive_of(entry, self.keep_alive)
        if entry.busy or wait is None or not entry.reloadable:
            return
        loop = asyncio.get_running_loop()
        _cancel(entry)
        entry.expiry = loop.call_later(wait, lambda: loop.create_task(self._expire(entry)))

    async def unload(self, entry: Entry) -> bool:
        """Unload `entry` now if it is loaded, idle and could be loaded again (Ollama's keep_alive 0 with nothing to
        generate); whether it is unloaded."""
        async with self._lock:
            entry.keep_alive = 0.0
            if expired(entry, self.clock(), 0.0):
                await asyncio.to_thread(self._drop, entry)
        return not entry.loaded

    async def _expire(self, entry: Entry) -> None:
        async with self._lock:
            if expired(entry, self.clock(), keep_alive_of(entry, self.keep_alive)):
                await asyncio.to_thread(self._drop, entry)

    def _drop(self, entry: Entry) -> None:
        """Unload: stop its decode thread, free its weights (and the GPU memory they held)."""
        engine, entry.engine, entry.group = entry.engine, None, None
        _cancel(entry)
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        else:
            engine.scheduler.close()
        del engine, close
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 -- freeing is best effort
            pass

    def close(self) -> None:
        for entry in self.entries:
            if entry.loaded and entry.reloadable:
                self._drop(entry)


def _cancel(entry: Entry) -> None:
    if entry.expiry is not None:
        entry.expiry.cancel()
        entry.expiry = None


def _available_ram() -> int:
    from moedesk.engine.host_memory import available_memory  # psutil's available, within a container's limit

    return available_memory()
