"""One writer per conversation: an advisory lock the operating system drops when its holder dies.

Two app windows on one data folder would otherwise each save their own copy of a conversation and the
later save would silently erase the other's turns. The window that opens a conversation first holds
`<id>.lock` beside it (flock: it conflicts across processes and across separate opens in one process,
and a killed window leaves no lock behind); any other window shows that conversation read-only.
The holder's pid is written into the file only so that the other window can say who has it.
"""
from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; every window may write, as before
    fcntl = None


class ConversationLock:
    """An exclusive lock on one path, taken without waiting; `release` (or the process ending) drops it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, path: Path) -> "ConversationLock | str":
        """The lock, or one line saying who holds it. OSError when the lock file cannot be made at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if fcntl is None:
                return cls(path, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                return "open in another window" + (f" (pid {holder})" if holder else "")
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
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return cls(path, fd)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove: bool = False) -> None:
        """Drop the lock; `remove` also deletes the lock file (done while still holding it, so that nobody holds
        a lock on a file that is gone)."""
        if self._fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __del__(self):
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
