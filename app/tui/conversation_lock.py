"""One writer per conversation: a lock per conversation file that a killed window does not keep.

Two app windows on one data folder would otherwise each save their own copy of a conversation and the
later save would silently erase the other's turns. The window that opens a conversation first holds
`<id>.lock` beside it; any other window shows that conversation read-only.

Two ways to hold it, behind one interface:

- flock, where the system has it (Linux, macOS): it conflicts across processes and across separate opens in
  one process, and the kernel drops it when its holder dies;
- elsewhere (Windows), a lock file created exclusively (O_EXCL) that names its holder. A holder that died
  leaves its file behind, so a file naming a process that is gone, or a new process that reused its pid
  (the start time differs), is stale and is broken. Chosen over msvcrt.locking because its byte locks
  are mandatory (the holder's pid could not be read from under them) and Windows refuses to delete a file
  another process keeps open, and because this one runs, and is tested, on every system.

Either way the file holds "<pid> <start time>", so that a reader can say who has a conversation without
taking its lock (`holder`). `moedesk batch` takes the same lock beside its output where flock is missing.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil

try:
    import fcntl
except ImportError:  # Windows: the lock-file fallback below
    fcntl = None

# A lock file still empty or garbled after this long was left by a holder killed between creating and
# writing it; younger, its writer may be about to fill it in.
UNWRITTEN_STALE_S = 10.0
# Breaking a stale lock takes microseconds; a breaker file older than this belongs to a process killed meanwhile.
BREAKER_STALE_S = 10.0
BUSY = "open in another window"


class ConversationLock:
    """An exclusive lock on one path, taken without waiting; `release` (or the process ending) drops it."""

    def __init__(self, path: Path, fd: int | None = None, stamp: str | None = None):
        self.path = path
        self._fd = fd  # the flock's descriptor
        self._stamp = stamp  # the lock file's content, when the file itself is the lock

    @classmethod
    def try_acquire(cls, path: Path) -> "ConversationLock | str":
        """The lock, or one line saying who holds it. OSError when the lock file cannot be made at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return _flock(cls, path) if fcntl is not None else _create_exclusively(cls, path)

    @staticmethod
    def holder(path: Path) -> int | None:
        """The pid of the live process holding `path` (this one included), read without taking the lock;
        None when nobody holds it."""
        text = _read(Path(path))
        pid, started = _parse(text or "")
        return pid if pid is not None and _alive(pid, started) else None

    @property
    def held(self) -> bool:
        return self._fd is not None or self._stamp is not None

    def release(self, remove: bool = False) -> None:
        """Drop the lock; `remove` also deletes the lock file (done while still holding it, so that nobody holds
        a lock on a file that is gone). A lock-file lock always deletes it: the file is the lock."""
        if self._fd is not None:
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
        elif self._stamp is not None:
            # Nobody else deletes a live holder's file. One that cannot be deleted now names this process until
            # it ends, and is then stale.
            with contextlib.suppress(OSError):
                _unlink_retrying(self.path)
            self._stamp = None

    def __del__(self):
        self.release()


def _flock(cls, path: Path) -> ConversationLock | str:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _ = _parse(os.pread(fd, 64, 0).decode("ascii", "replace"))
            os.close(fd)
            return _busy(pid)
        except BaseException:
            os.close(fd)
            raise
        # A holder that deleted the conversation unlinked this file after we opened it: locking the old inode
        # would lock nothing anyone else sees, so open the path again.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _stamp().encode(), 0)
            return cls(path, fd=fd)
        os.close(fd)


def _create_exclusively(cls, path: Path) -> ConversationLock | str:
    stamp = _stamp()
    for attempt in range(50):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            text = _read(path)
            if text is None:
                continue  # released just now: try again
            pid, started = _parse(text)
            if pid is not None and _alive(pid, started):
                return _busy(pid)
            if pid is None and _age(path) < UNWRITTEN_STALE_S:
                return _busy(None)  # being written, or garbled only just now
            _break_stale(path, text)
            time.sleep(0.002 * attempt)  # another window may be breaking it too
            continue
        try:
            os.write(fd, stamp.encode())
        except BaseException:
            os.close(fd)
            _unlink_retrying(path)
            raise
        os.close(fd)
        return cls(path, stamp=stamp)
    return _busy(None)


def _break_stale(path: Path, seen: str) -> None:
    """Delete the lock file if it still holds `seen`, one breaker at a time: without the breaker file, a window
    that found the same stale lock a moment later could delete the new holder's file instead."""
    breaker = path.with_name(path.name + ".break")
    try:
        fd = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if _age(breaker) > BREAKER_STALE_S:
            _unlink_retrying(breaker)
        return
    try:
        if _read(path) == seen:
            _unlink_retrying(path)
    finally:
        os.close(fd)
        _unlink_retrying(breaker)


def _busy(pid: int | None) -> str:
    return BUSY + (f" (pid {pid})" if pid else "")


def _stamp() -> str:
    return f"{os.getpid()} {_started(os.getpid())}\n"


def _started(pid: int) -> str:
    """When the process started, as the lock file writes it ("?" when the system does not say)."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, OSError):
        return "?"


def _parse(text: str) -> tuple[int | None, float | None]:
    parts = text.split()
    if not parts or not parts[0].isdigit():
        return None, None
    try:
        started = float(parts[1]) if len(parts) > 1 else None
    except ValueError:
        started = None
    return int(parts[0]), started


def _alive(pid: int, started: float | None) -> bool:
    """Whether the process that wrote a lock file still runs: its pid exists, is not a zombie, and (where both
    times are known) started when the file says, so a pid reused by another process does not count."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        now_started = process.create_time()
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # it exists, but this user may not look closer
    return started is None or abs(now_started - started) < 1.0


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(64).decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:
        return ""  # unreadable: treated as unwritten


def _age(path: Path) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _unlink_retrying(path: Path) -> None:
    # Windows refuses to delete a file while another process has it open, which a reader does for microseconds.
    for attempt in range(20):
        try:
            os.unlink(path)
            return
        except FileNotFoundError:
            return
        except PermissionError:
            if attempt == 19:
                raise
            time.sleep(0.01)
