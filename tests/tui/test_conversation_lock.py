"""The lock-file fallback for systems without fcntl (Windows), forced here by taking fcntl away: a lock file
left by a process that is gone, or whose pid another process now has, is broken; one being written is not."""
from __future__ import annotations

import importlib
import os
import sys
import time

import psutil
import pytest

from moedesk.app.tui import conversation_lock
from moedesk.app.tui.conversation_lock import ConversationLock


@pytest.fixture(autouse=True)
def without_fcntl():
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "fcntl", None)
        importlib.reload(conversation_lock)
    assert conversation_lock.fcntl is None
    yield
    importlib.reload(conversation_lock)


def test_the_file_is_the_lock_and_names_its_holder(tmp_path):
    path = tmp_path / "c.lock"
    lock = ConversationLock.try_acquire(path)
    assert isinstance(lock, ConversationLock) and lock.held
    pid, started = path.read_text().split()
    assert int(pid) == os.getpid() and abs(float(started) - psutil.Process().create_time()) < 1
    assert ConversationLock.try_acquire(path) == f"open in another window (pid {os.getpid()})"
    assert ConversationLock.holder(path) == os.getpid()
    lock.release()
    assert not path.exists() and not lock.held
    assert ConversationLock.holder(path) is None
    again = ConversationLock.try_acquire(path)
    assert isinstance(again, ConversationLock)
    again.release()


def test_a_pid_reused_by_another_process_does_not_hold_the_lock(tmp_path):
    # This process's pid with another start time: what a window killed long ago leaves when its pid is reused.
    path = tmp_path / "c.lock"
    path.write_text(f"{os.getpid()} {psutil.Process().create_time() - 3600:.2f}\n")
    assert ConversationLock.holder(path) is None
    lock = ConversationLock.try_acquire(path)
    assert isinstance(lock, ConversationLock)
    assert path.read_text() == f"{os.getpid()} {psutil.Process().create_time():.2f}\n"
    lock.release()


def test_a_lock_file_being_written_is_respected_and_an_old_unwritten_one_is_broken(tmp_path):
    path = tmp_path / "c.lock"
    path.write_text("")  # a holder between creating the file and writing its pid
    assert ConversationLock.try_acquire(path) == "open in another window"
    old = time.time() - conversation_lock.UNWRITTEN_STALE_S - 1
    os.utime(path, (old, old))  # ...or one killed at that moment, long ago
    lock = ConversationLock.try_acquire(path)
    assert isinstance(lock, ConversationLock)
    lock.release()


def test_a_breaker_killed_while_breaking_does_not_block_for_ever(tmp_path):
    path, breaker = tmp_path / "c.lock", tmp_path / "c.lock.break"
    path.write_text("999999999 1.00\n")  # no such process
    breaker.write_text("")
    old = time.time() - conversation_lock.BREAKER_STALE_S - 1
    os.utime(breaker, (old, old))
    lock = ConversationLock.try_acquire(path)
    assert isinstance(lock, ConversationLock)
    assert not breaker.exists()
    lock.release()


def test_a_window_late_to_break_a_stale_lock_leaves_the_new_holder_alone(tmp_path):
    # Two windows found the same stale lock; the first broke it and holds the conversation now. The second,
    # going on with what it read, must not delete the first one's lock.
    path = tmp_path / "c.lock"
    path.write_text("999999999 1.00\n")
    seen = path.read_text()
    first = ConversationLock.try_acquire(path)
    assert isinstance(first, ConversationLock)
    conversation_lock._break_stale(path, seen)
    assert ConversationLock.holder(path) == os.getpid()
    assert ConversationLock.try_acquire(path) == f"open in another window (pid {os.getpid()})"
    first.release()
