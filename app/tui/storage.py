"""Where the app keeps its files, atomic JSON writes, and saved conversations. No Textual here.

Folders (each overridable by an environment variable, which the tests use):

- data: ``platformdirs.user_data_dir("moedesk")`` or ``MOEDESK_DATA_DIR``; conversations live in
  ``<data>/conversations/<id>.json``;
- config: ``platformdirs.user_config_dir("moedesk")`` or ``MOEDESK_CONFIG_DIR``;
- models: ``<data>/models`` or ``MOEDESK_MODELS_DIR``.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import platformdirs

from moedesk.app.tui.conversation_lock import ConversationLock
from moedesk.engine import json_read


def data_dir() -> Path:
    return Path(os.environ.get("MOEDESK_DATA_DIR") or platformdirs.user_data_dir("moedesk"))


def config_dir() -> Path:
    return Path(os.environ.get("MOEDESK_CONFIG_DIR") or platformdirs.user_config_dir("moedesk"))


def models_dir() -> Path:
    return Path(os.environ.get("MOEDESK_MODELS_DIR") or data_dir() / "models")


def atomic_write_json(path: Path, value) -> None:
    """Write `value` as JSON so that `path` holds either the old or the new content, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path):
    """The JSON value in `path`; OSError or ValueError (json.JSONDecodeError) when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        return json_read.loads(f.read())


def set_aside(path: Path) -> Path:
    """Rename an unreadable file to `<name>.unreadable-<time>` beside it, so that nothing writes over it and
    nothing reads it as a good file again; returns the new path (OSError when it cannot be renamed)."""
    path = Path(path)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.unreadable-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.unreadable-{stamp}-{n}")
    os.replace(path, target)
    return target


def _try_lock(path: Path) -> ConversationLock | None:
    try:
        lock = ConversationLock.try_acquire(path)
    except OSError:
        return None
    return lock if isinstance(lock, ConversationLock) else None


def now_iso() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------- conversations

TITLE_LENGTH = 60


@dataclass
class Message:
    """One turn. `meta` holds what the engine reported for a reply: finish_reason, tokens, stats, model."""

    role: str  # "user" | "assistant"
    content: str
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.meta:
            out["meta"] = self.meta
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Message":
        if not isinstance(d, dict) or d.get("role") not in ("user", "assistant", "system") \
                or not isinstance(d.get("content"), str):
            raise ValueError(f"not a message: {str(d)[:80]}")
        meta = d.get("meta")
        return cls(d["role"], d["content"], meta if isinstance(meta, dict) else {})


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: new_conversation_id())
    title: str = ""
    created: str = field(default_factory=now_iso)
    updated: str = ""
    model: str = ""
    messages: list[Message] = field(default_factory=list)

    def add(self, role: str, content: str, **meta) -> Message:
        message = Message(role, content, dict(meta))
        self.messages.append(message)
        if not self.title and role == "user":
            self.title = make_title(content)
        return message

    def last(self, role: str) -> Message | None:
        return next((m for m in reversed(self.messages) if m.role == role), None)

    def chat_messages(self, system_prompt: str = "") -> list[dict]:
        """What the model's chat template gets: the system prompt (if any) and every turn, role and content only."""
        out = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        out += [{"role": m.role, "content": m.content} for m in self.messages]
        return out

    def to_dict(self) -> dict:
        return {"version": 1, "id": self.id, "title": self.title, "created": self.created,
                "updated": self.updated, "model": self.model, "messages": [m.to_dict() for m in self.messages]}

    @classmethod
    def from_dict(cls, d: dict) -> "Conversation":
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("messages"), list):
            raise ValueError("not a conversation")
        return cls(id=d["id"], title=str(d.get("title") or ""), created=str(d.get("created") or ""),
                   updated=str(d.get("updated") or ""), model=str(d.get("model") or ""),
                   messages=[Message.from_dict(m) for m in d["messages"]])


def conversation_markdown(conversation: Conversation) -> str:
    """The conversation as a Markdown document: its title, then each turn under a heading naming who spoke."""
    lines = [f"# {conversation.title or 'Conversation'}", ""]
    when = (conversation.updated or conversation.created)[:16].replace("T", " ")
    about = " · ".join(part for part in (conversation.model, when) if part)
    if about:
        lines += [f"_{about}_", ""]
    for m in conversation.messages:
        if m.role == "user":
            heading = "You"
        elif m.role == "assistant":
            heading = str(m.meta.get("model") or conversation.model or "Assistant").rstrip("/").rsplit("/", 1)[-1]
        else:
            heading = m.role.capitalize()
        lines += [f"## {heading}", "", m.content.rstrip(), ""]
    return "\n".join(lines)


def export_folder() -> Path:
    """Where an exported chat goes unless the user types another path: their documents folder, not wherever the
    app happened to be started."""
    return Path(platformdirs.user_documents_dir())


def export_file_name(conversation: Conversation) -> str:
    """A file name from the title: letters, digits and dashes, so that it is safe on every system."""
    words = "".join(c if c.isalnum() else " " for c in (conversation.title or "")).split()
    return ("-".join(words)[:60].strip("-") or conversation.id) + ".md"


def new_conversation_id() -> str:
    # Sorts by creation time; the random tail keeps two chats started in the same second apart.
    return datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def make_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1] + "…"


@dataclass(frozen=True)
class ConversationInfo:
    id: str
    title: str
    updated: str
    model: str
    turns: int


class ConversationBusy(OSError):
    """Another window holds this conversation: saving or deleting it here would undo what that window wrote."""


class ConversationStore:
    """Conversations as one JSON file each in a folder; unreadable files are skipped, never deleted.

    A store (one per app window) writes only the conversation it holds (see `hold`): a second window on the
    same folder can read a conversation the first has open, never save over it.

    `state.json` beside the folder remembers which conversation was open last, so a restart
    returns to it even when an older one was reopened; `draft.json` holds the message being typed
    and not yet sent, so that a restart or a crash does not lose it.
    """

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else data_dir() / "conversations"
        self.state_path = self.folder.parent / "state.json"
        self._lock: ConversationLock | None = None
        self._lock_id: str | None = None
        self._draft_path: Path | None = None
        self._draft_lock: ConversationLock | None = None

    @property
    def draft_path(self) -> Path:
        """Where the unsent message is kept: draft.json, or a second window's own file (see `claim_draft`)."""
        return self._draft_path or self.folder.parent / "draft.json"

    def claim_draft(self) -> None:
        """An app window starts: draft.json is its if it is the first window on this folder; a second one gets a
        file of its own (draft-<pid>-<random>.json), so that two windows never write over each other's message.
        The first window to start after that one closed takes its message back (`load_draft`)."""
        if self._draft_lock is not None:
            return
        path = self.folder.parent / "draft.json"
        lock = _try_lock(path.with_suffix(".lock"))
        if lock is None:
            path = self.folder.parent / f"draft-{os.getpid()}-{secrets.token_hex(3)}.json"
            lock = _try_lock(path.with_suffix(".lock"))  # held while this window runs: not an orphan yet
        self._draft_path, self._draft_lock = path, lock

    def close(self) -> None:
        """The window closes: let go of its conversation and its draft file (a second window's empty one goes)."""
        self.let_go()
        path, lock = self._draft_path, self._draft_lock
        if path is not None and path.name != "draft.json":
            try:
                if not read_json(path).get("text"):
                    path.unlink()
            except (OSError, ValueError, AttributeError):
                pass
        if lock is not None:
            lock.release(remove=True)
        self._draft_path, self._draft_lock = None, None

    # ------------------------------------------------------------------ who may write which conversation

    def hold(self, conversation_id: str) -> str:
        """Make this store the one writer of `conversation_id`, letting go of the one it held before. '' when it
        holds it now, else one line saying why not (another window has it open). The caller reads the
        conversation again after a successful hold: another window may have written it meanwhile."""
        if self.holds(conversation_id):
            return ""
        try:
            lock = ConversationLock.try_acquire(self.lock_path(conversation_id))
        except OSError as e:
            return f"cannot lock the conversation ({e})"
        if isinstance(lock, str):
            return f"This chat is {lock}"
        self.let_go()
        self._lock, self._lock_id = lock, conversation_id
        return ""

    def holds(self, conversation_id: str) -> bool:
        return self._lock_id == conversation_id and self._lock is not None and self._lock.held

    def let_go(self) -> None:
        """Stop holding any conversation (another window may then write it)."""
        if self._lock is not None:
            self._lock.release(remove=True)  # no lock file left behind per conversation ever opened
        self._lock, self._lock_id = None, None

    def held_elsewhere(self) -> set[str]:
        """The conversations another window has open (read from their lock files without taking the locks)."""
        held = set()
        for lock in self.folder.glob("*.lock") if self.folder.is_dir() else ():
            if not self.holds(lock.stem) and ConversationLock.holder(lock) is not None:
                held.add(lock.stem)
        return held

    def lock_path(self, conversation_id: str) -> Path:
        return self.path(conversation_id).with_suffix(".lock")

    def save_draft(self, text: str) -> None:
        """Keep the unsent message (atomically: a write cut short leaves the previous draft); OSError if it cannot."""
        atomic_write_json(self.draft_path, {"version": 1, "text": text})

    def load_draft(self) -> tuple[str, str]:
        """(the unsent message of the last run, a problem to report). A draft file that cannot be read is set
        aside (see `set_aside`), never overwritten by the next draft. The first window also takes back what
        second windows, closed since, left unsent (one message after another), and keeps it in draft.json
        before their files go."""
        text, problem = self._read_draft(self.draft_path)
        if self.draft_path.name != "draft.json":
            return "", ""  # a second window: draft.json is the first one's message, on its screen
        left = self._orphan_drafts()
        if not left or problem:
            return text, problem
        merged = "\n\n".join(t for t in [text, *(t for _, t in left)] if t)
        try:
            self.save_draft(merged)
        except OSError:
            return text, problem  # their files stay for a later start
        for path, _ in left:
            with contextlib.suppress(OSError):
                path.unlink()
        return merged, ""

    def _orphan_drafts(self) -> list[tuple[Path, str]]:
        """Drafts of second windows that are gone (their lock is free), with their text; oldest first."""
        found = []
        for path in sorted(self.folder.parent.glob("draft-*.json"), key=lambda p: p.stat().st_mtime):
            lock = _try_lock(path.with_suffix(".lock"))
            if lock is None:
                continue  # that window still runs
            lock.release(remove=True)
            try:
                value = read_json(path)
            except (OSError, ValueError):
                continue
            if isinstance(value, dict) and isinstance(value.get("text"), str):
                found.append((path, value["text"]))
        return found

    def _read_draft(self, path: Path) -> tuple[str, str]:
        try:
            value = read_json(path)
        except FileNotFoundError:
            return "", ""
        except (OSError, ValueError) as e:
            value, error = None, e
        if isinstance(value, dict) and isinstance(value.get("text"), str):
            return value["text"], ""
        if value is not None:
            error = ValueError("no text in it")
        try:
            kept = f"kept as {set_aside(path).name}"
        except OSError as e2:
            kept = f"left where it is ({e2})"
        return "", f"The unsent message of the last run could not be read ({error}); {kept}."

    def set_aside_unreadable(self) -> list[str]:
        """Set aside every conversation file that cannot be parsed (see `set_aside`); one line each for the user.
        Files that cannot be opened at all (permissions) are reported and left where they are."""
        problems = []
        if not self.folder.is_dir():
            return problems
        for file in sorted(self.folder.glob("*.json")):
            try:
                Conversation.from_dict(read_json(file))
            except OSError as e:
                problems.append(f"Conversation {file.stem} cannot be read: {e}")
            except ValueError as e:
                try:
                    kept = f"kept as {set_aside(file)}"
                except OSError as e2:
                    kept = f"left where it is ({e2})"
                problems.append(f"Conversation {file.stem} could not be read ({str(e)[:120]}); {kept}.")
        return problems

    def remember(self, conversation_id: str | None) -> None:
        """Note the conversation on screen now (None: a new, still empty chat)."""
        try:
            atomic_write_json(self.state_path, {"last_conversation": conversation_id})
        except OSError:
            pass  # losing the pointer only costs the choice of chat on the next start

    def path(self, conversation_id: str) -> Path:
        if not conversation_id or "/" in conversation_id or "\\" in conversation_id or conversation_id.startswith("."):
            raise ValueError(f"bad conversation id {conversation_id!r}")
        return self.folder / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> None:
        """Write the conversation; ConversationBusy (an OSError) when another window holds it. A conversation this
        store does not hold is locked only for the write."""
        with self._writing(conversation.id):
            conversation.updated = now_iso()
            atomic_write_json(self.path(conversation.id), conversation.to_dict())

    def load(self, conversation_id: str) -> Conversation:
        return Conversation.from_dict(read_json(self.path(conversation_id)))

    def delete(self, conversation_id: str) -> None:
        """Remove the conversation; ConversationBusy (an OSError) when another window has it open. The one this
        store holds stays held unless it is the one deleted."""
        with self._writing(conversation_id):
            try:
                self.path(conversation_id).unlink()
            except FileNotFoundError:
                pass
        if self.holds(conversation_id):
            self.let_go()

    @contextmanager
    def _writing(self, conversation_id: str):
        if self.holds(conversation_id):
            yield
            return
        lock = ConversationLock.try_acquire(self.lock_path(conversation_id))
        if isinstance(lock, str):
            raise ConversationBusy(f"This chat is {lock}")
        try:
            yield
        finally:
            lock.release(remove=True)

    def list(self) -> list[ConversationInfo]:
        """Every readable conversation, most recently updated first."""
        infos = []
        if not self.folder.is_dir():
            return infos
        for file in self.folder.glob("*.json"):
            try:
                c = Conversation.from_dict(read_json(file))
            except (OSError, ValueError):
                continue
            if c.id != file.stem:
                continue
            infos.append(ConversationInfo(c.id, c.title or "(untitled)", c.updated or c.created, c.model,
                                          sum(m.role == "user" for m in c.messages)))
        infos.sort(key=lambda i: (i.updated, i.id), reverse=True)
        return infos

    def latest(self) -> Conversation | None:
        """The conversation open when the app last ran, else the most recently updated one."""
        try:
            state = read_json(self.state_path)
        except (OSError, ValueError):
            state = {}
        if isinstance(state, dict) and "last_conversation" in state:
            remembered = state["last_conversation"]
            if remembered is None:
                return None  # the app was left on a new, empty chat
            try:
                return self.load(str(remembered))
            except (OSError, ValueError):
                pass
        for info in self.list():
            try:
                return self.load(info.id)
            except (OSError, ValueError):
                continue
        return None
