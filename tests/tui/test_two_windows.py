"""Two app windows on one data folder never lose a turn: the first to open a conversation is its one writer
(a lock the operating system drops when that window dies); the second shows it read-only and says so."""
from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys

import pytest

from moedesk.app.tui import MoedeskApp, conversation_lock
from moedesk.app.tui.storage import Conversation, ConversationBusy, ConversationStore
from tests.tui.helpers import chat_ready, greedy_settings, wait_for, wait_idle

SIZE = (100, 30)

# A child process that holds a conversation, told which lock to use: the lock-file fallback is forced by
# taking fcntl away before anything imports it, as on a system without it.
HOLDER = """
import sys
if {fallback!r}:
    sys.modules["fcntl"] = None
from moedesk.app.tui.storage import ConversationStore
store = ConversationStore()
assert store.hold({cid!r}) == ""
print("held", flush=True)
if sys.stdin.readline():
    store.let_go()
    print("let go", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture(params=["flock", "lock file"])
def lock_kind(request):
    """Each test runs with the lock this system has and again with the fallback for systems without fcntl."""
    fallback = request.param == "lock file"
    if fallback:
        with pytest.MonkeyPatch.context() as m:
            m.setitem(sys.modules, "fcntl", None)
            importlib.reload(conversation_lock)
        assert conversation_lock.fcntl is None
    yield request.param
    if fallback:
        importlib.reload(conversation_lock)
    assert conversation_lock.fcntl is not None


def start_holder(conversation_id: str, fallback: bool) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER.format(fallback=fallback, cid=conversation_id)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def saved_turns(store: ConversationStore, conversation_id: str) -> list[str]:
    return [m.content for m in store.load(conversation_id).messages]


def a_saved_conversation(store: ConversationStore) -> Conversation:
    c = Conversation()
    c.add("user", "first question")
    c.add("assistant", "first answer")
    store.save(c)
    return c


def test_a_second_store_cannot_save_or_delete_what_the_first_holds(tui_dirs, lock_kind):
    a, b = ConversationStore(), ConversationStore()
    c = a_saved_conversation(a)
    assert not a.holds(c.id)  # a save alone locks only while it writes
    assert a.hold(c.id) == ""
    assert "open in another window" in b.hold(c.id)

    stale = b.load(c.id)
    stale.add("user", "from b")
    with pytest.raises(ConversationBusy, match="open in another window"):
        b.save(stale)
    with pytest.raises(ConversationBusy):
        b.delete(c.id)
    assert saved_turns(a, c.id) == ["first question", "first answer"]

    # The holder writes on; once it lets go, the other store may write (after reading the newest copy).
    mine = a.load(c.id)
    mine.add("user", "from a")
    a.save(mine)
    a.let_go()
    assert b.hold(c.id) == ""
    assert "open in another window" in a.hold(c.id)
    assert saved_turns(b, c.id) == ["first question", "first answer", "from a"]
    assert not list(b.folder.glob("*.tmp"))


def test_deleting_another_conversation_keeps_the_open_one_held(tui_dirs, lock_kind):
    a, b = ConversationStore(), ConversationStore()
    open_one, other = a_saved_conversation(a), Conversation()
    other.add("user", "old")
    b.save(other)
    a.hold(open_one.id)
    a.delete(other.id)
    assert a.holds(open_one.id) and not b.path(other.id).exists()
    assert not b.lock_path(other.id).exists()  # no lock file left for a conversation that is gone
    assert b.hold(open_one.id) != ""


def test_a_killed_window_leaves_no_lock_behind(tui_dirs, lock_kind):
    store = ConversationStore()
    c = a_saved_conversation(store)
    child = start_holder(c.id, fallback=lock_kind == "lock file")
    try:
        busy = store.hold(c.id)
        assert f"pid {child.pid}" in busy  # says who has it
        assert store.held_elsewhere() == {c.id}
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()
    # Its lock file is still there (the fallback's file is the lock), naming a process that is gone.
    assert store.lock_path(c.id).read_text().split()[0] == str(child.pid)
    assert store.held_elsewhere() == set()
    assert store.hold(c.id) == ""
    assert ConversationStore().hold(c.id) != ""  # and the new holder's lock works
    store.let_go()
    assert not store.lock_path(c.id).exists()


def test_a_window_that_lets_go_frees_the_conversation_at_once(tui_dirs, lock_kind):
    store = ConversationStore()
    c = a_saved_conversation(store)
    child = start_holder(c.id, fallback=lock_kind == "lock file")
    try:
        assert "open in another window" in store.hold(c.id)
        child.stdin.write("let go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "let go"
        assert store.held_elsewhere() == set()
        assert store.hold(c.id) == ""  # while that window still runs
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdin.close()
        child.stdout.close()


@pytest.mark.anyio
async def test_two_windows_on_one_folder_keep_every_turn(engine, tui_dirs, lock_kind):
    c = a_saved_conversation(ConversationStore())
    first = MoedeskApp(engine, settings=greedy_settings())
    second = MoedeskApp(engine, settings=greedy_settings())
    async with first.run_test(size=SIZE) as a:
        await wait_for(a, lambda: chat_ready(first), what="the first window")
        async with second.run_test(size=SIZE) as b:
            await wait_for(b, lambda: chat_ready(second), what="the second window")
            # Both reopened the same conversation; only the first may write it.
            assert first.chat.conversation.id == second.chat.conversation.id == c.id
            assert not first.chat.read_only
            assert "open in another window" in second.chat.read_only
            assert any("open in another window" in str(n.message) for n in second._notifications)
            assert "read-only" in str(second.chat.query_one("#chat-status").render())

            first.chat.prompt.focus()
            await a.press(*"from a", "enter")
            await wait_idle(a, first)
            second.chat.prompt.focus()
            await b.press(*"from b", "enter")
            await b.pause()
            assert second.chat.prompt.text == "from b"  # refused, and kept
            assert "not sent" in str(second.chat.query_one("#chat-status").render())
            assert second.chat.generation is None
            assert saved_turns(ConversationStore(), c.id)[2] == "from a"

            await a.press("ctrl+q")  # the first window closes: the second may take the chat over
            await a.pause()
            await b.press("enter")
            await wait_idle(b, second)
            assert not second.chat.read_only
            assert second.chat.prompt.text == ""
    turns = saved_turns(ConversationStore(), c.id)
    assert turns[:3] == ["first question", "first answer", "from a"]
    assert turns[4] == "from b" and len(turns) == 6  # the first window's exchange, then the second's
    assert [m["role"] for m in json.loads(ConversationStore().path(c.id).read_text())["messages"]] == \
        ["user", "assistant"] * 3


@pytest.mark.anyio
async def test_two_windows_unsent_messages_both_come_back(engine, tui_dirs, monkeypatch, lock_kind):
    from moedesk.app.tui.screens.chat import ChatScreen

    monkeypatch.setattr(ChatScreen, "DRAFT_SAVE_S", 0.05)
    first = MoedeskApp(engine, settings=greedy_settings())
    second = MoedeskApp(engine, settings=greedy_settings())
    async with first.run_test(size=SIZE) as a:
        await wait_for(a, lambda: chat_ready(first), what="the first window")
        async with second.run_test(size=SIZE) as b:
            await wait_for(b, lambda: chat_ready(second), what="the second window")
            first.chat.prompt.focus()
            await a.press(*"typed in a")
            second.chat.prompt.focus()
            await b.press(*"typed in b")
            await wait_for(b, lambda: len(list(tui_dirs["data"].glob("draft*.json"))) == 2, what="both drafts")
            await a.pause(0.2)
            await b.press("ctrl+q")
        await a.press("ctrl+q")  # each quit with its message unsent: once, the last one wrote over the other
    third = MoedeskApp(engine, settings=greedy_settings())
    async with third.run_test(size=SIZE) as c:
        await wait_for(c, lambda: chat_ready(third), what="a new window")
        assert third.chat.prompt.text == "typed in a\n\ntyped in b"
    assert [p.name for p in tui_dirs["data"].glob("draft*.json")] == ["draft.json"]
    assert not list(tui_dirs["data"].glob("*.lock"))


def test_a_second_window_that_sent_everything_leaves_no_draft_file(tui_dirs, lock_kind):
    a, b = ConversationStore(), ConversationStore()
    a.claim_draft()
    b.claim_draft()
    a.save_draft("a's")
    b.save_draft("b's")
    assert a.draft_path.name == "draft.json" and b.draft_path.name.startswith("draft-")
    assert b.load_draft() == ("", "")  # not the first window's message, which is on its screen
    b.save_draft("")
    b.close()
    a.close()
    c = ConversationStore()
    c.claim_draft()
    assert c.load_draft() == ("a's", "")
    c.close()
    assert [p.name for p in tui_dirs["data"].glob("draft*")] == ["draft.json"]


@pytest.mark.anyio
async def test_the_chats_list_marks_what_another_window_has_open(engine, tui_dirs, monkeypatch, lock_kind):
    from moedesk.app.tui.screens.conversations import ConversationsScreen

    monkeypatch.setattr(ConversationsScreen, "WATCH_S", 0.05)
    store = ConversationStore()
    elsewhere, other, current = (Conversation(id=f"2025010{n}-000000-aaaaaa") for n in range(1, 4))
    for c in (elsewhere, other, current):
        c.add("user", f"question of {c.id[:8]}")
        store.save(c)
    store.remember(current.id)
    window = start_holder(elsewhere.id, fallback=lock_kind == "lock file")
    app = MoedeskApp(engine, settings=greedy_settings())

    def marked(screen) -> set[str]:
        options = screen.query_one("#conversations")
        return {options.get_option_at_index(i).id for i in range(options.option_count)
                if "open in another window" in str(options.get_option_at_index(i).prompt)}

    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: chat_ready(app), what="the window")
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), what="the list")
            picker = app.screen
            assert marked(picker) == {elsewhere.id}  # not the one open here, which has its own mark
            assert not store.lock_path(other.id).exists()  # read without taking the lock
            row = [i.id for i in picker.infos].index(elsewhere.id)
            picker.query_one("#conversations").highlighted = row

            third = ConversationStore()  # a window in this process opens another chat: marked too
            assert third.hold(other.id) == ""
            await wait_for(pilot, lambda: marked(picker) == {elsewhere.id, other.id}, what="the new mark")
            third.let_go()
            window.stdin.write("let go\n")  # the other process's window moves on
            window.stdin.flush()
            assert window.stdout.readline().strip() == "let go"
            await wait_for(pilot, lambda: marked(picker) == set(), what="the marks to go")
            assert picker.query_one("#conversations").highlighted == row  # the cursor stayed where it was

            await pilot.press("enter")  # and it opens writable here now
            await wait_for(pilot, lambda: chat_ready(app) and app.chat.conversation.id == elsewhere.id,
                           what="the chat")
            assert not app.chat.read_only
    finally:
        window.kill()
        window.wait(timeout=10)
        window.stdin.close()
        window.stdout.close()
