"""The chat: messages, the input box, the stats panel; replies stream from a thread worker.

The engine's `stream` is a blocking generator, so it runs in a thread worker. The worker folds
the text of tokens that arrive within `STREAM_INTERVAL_S` into one `ReplyDelta` message (posting
is thread-safe and does not wait for the UI), and the reply widget's MarkdownStream folds any
backlog once more, so a fast model never makes the UI re-parse Markdown once per token. Every
message carries its generation's number; messages of a generation that was replaced are dropped.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header, Static, TextArea

from moedesk.app.tui.catalog import human_size
from moedesk.app.tui.storage import Conversation
from moedesk.app.tui.widgets.load_panel import one_line, short_model_name
from moedesk.app.tui.widgets.messages import AssistantMessage, UserMessage
from moedesk.app.tui.widgets.prompt import PromptArea
from moedesk.app.tui.widgets.stats import StatsPanel
from moedesk.engine.load.reply_format import parse_reply, starts_in_reasoning
from moedesk.engine.load.reply_stream import ReplyStream

MAP_REFRESH_S = 0.5


class ReplyDelta(Message):
    """New answer text and reasoning text (a thinking model's, told apart by engine.load.reply_format)."""

    def __init__(self, generation: int, text: str, tokens: int, reasoning: str = ""):
        super().__init__()
        self.generation, self.text, self.tokens, self.reasoning = generation, text, tokens, reasoning


class ReplyDone(Message):
    """The finished reply: `answer` and `reasoning` are all of each; `tail` / `reasoning_tail` what was not
    posted yet."""

    def __init__(self, generation: int, completion, tail: str, answer: str, reasoning: str = "",
                 reasoning_tail: str = ""):
        super().__init__()
        self.generation, self.completion, self.tail = generation, completion, tail
        self.answer, self.reasoning, self.reasoning_tail = answer, reasoning, reasoning_tail


class ReplyFailed(Message):
    """`tail`: text the worker had not posted yet when the reply failed, shown with what was."""

    def __init__(self, generation: int, error: str, tail: str = ""):
        super().__init__()
        self.generation, self.error, self.tail = generation, error, tail


class Measuring(Message):
    """auto's one-off measurement of this machine's step times, `done` in [0, 1], before its first reply here."""

    def __init__(self, generation: int, done: float):
        super().__init__()
        self.generation, self.done = generation, done


@dataclass
class Generation:
    number: int
    cancel: threading.Event
    widget: AssistantMessage
    prompt_tokens: int
    started: float
    tokens: int = 0
    map_shown_at: float = 0.0
    fragments: list[str] = field(default_factory=list)
    status: str = ""  # what the status line says while it runs


def model_summary(engine) -> str:
    cfg = engine.config
    experts = f"{cfg.num_experts} experts, {cfg.num_experts_per_tok} per token" if cfg.is_moe else "dense"
    dtype = str(engine.dtype).removeprefix("torch.") if engine.dtype is not None else "file's formats"
    spread = device_summary(engine.expert_stats()) if cfg.is_moe and hasattr(engine, "expert_stats") else ""
    return f"{short_model_name(engine.name)}\n{cfg.arch} · {cfg.num_layers} layers\n{experts}\n" \
           f"{engine.device.type} · {dtype} · context {engine.context_length:,}\n{engine.why}{spread}"


def count_sample(engine) -> tuple[int | None, int | None, bool]:
    """One decode step in how many the engine counts the routers' picks of (llama.cpp's sample), in layers whose
    experts are in RAM and on the GPU (None: all); and whether it counts at all (the Count expert picks setting)."""
    if not engine.config.is_moe or not hasattr(engine, "expert_stats"):
        return None, None, True
    stats = engine.expert_stats()
    return stats.get("count_every"), stats.get("gpu_count_every"), stats.get("expert_counts") is not False


def device_summary(expert_stats: dict) -> str:
    """Which GPU holds which MoE layers and how many of their experts, and how much of its budget it holds, a line
    each, where the layers run on several GPUs (the engine's expert stats list them); '' on one."""
    return "".join(f"\nGPU {d['device']}: MoE layers {d['moe_layers'][0]}-{d['moe_layers'][1]} · "
                   f"{d['experts_on_gpu']} experts" + _budget(d) for d in expert_stats.get("devices", ()))


def _budget(device: dict) -> str:
    if device.get("budget_bytes") is None:
        return ""
    return f" · {human_size(device['held_bytes'])} of {human_size(device['budget_bytes'])}"


def row_devices(engine) -> tuple[list[int] | None, tuple[str, ...]]:
    """Per heat-map row (MoE layer), the GPU holding it, and each GPU's torch device, where the layers run on
    several GPUs; (None, ()) on one."""
    if not engine.config.is_moe or not hasattr(engine, "expert_stats"):
        return None, ()
    lines = engine.expert_stats().get("devices") or []
    if len(lines) < 2:
        return None, ()
    names = [""] * (max(d["device"] for d in lines) + 1)
    for d in lines:
        names[d["device"]] = d["torch_device"]
    owner = [next((d["device"] for d in lines if d["moe_layers"][0] <= i <= d["moe_layers"][1]), 0)
             for i in range(engine.config.num_layers) if engine.config.is_moe_layer(i)]
    return owner, tuple(names)


def writing(decoding) -> str:
    """What the status line says while a reply is being written."""
    beams = getattr(decoding, "beams", None)
    if beams is not None:
        return f"searching {beams} beams… the best reply appears when the search ends ·"
    mode = getattr(decoding, "mode", None)
    return f"writing (speculative, {mode})…" if mode else "writing…"


def moe_layer_labels(engine) -> list[str]:
    cfg = engine.config
    return [f"L{i}" for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]


class ChatScreen(Screen):
    """One conversation with the loaded model."""

    STREAM_INTERVAL_S = 1 / 30  # the worker posts at most this often (tests set 0: one message per token)

    # Below this width the stats panel leaves the chat too little room (code lines were cut at 80
    # columns), so it starts hidden there; ctrl+t still shows it.
    STATS_AUTO_WIDTH = 100

    # The unsent message is written to disk at most this long after it changed (a crash loses at most this much
    # typing), and at once when the screen is left, the app quits or the message is sent.
    DRAFT_SAVE_S = 0.5

    # Copy and Redo are left out of the footer so that Quit and the palette fit at 80 columns; they are in
    # the empty chat's key list, the command palette and the README.
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Redo", show=False),
        Binding("ctrl+n", "new_chat", "New"),
        # priority: the focused input box (a TextArea) would take ctrl+y as redo
        Binding("ctrl+y", "copy_reply", "Copy", show=False, priority=True),
        Binding("ctrl+o", "conversations", "Chats"),
        Binding("ctrl+t", "toggle_stats", "Stats"),
        Binding("f4", "maximize_stats", "Stats full screen", show=False),
        Binding("f2", "app.settings", "Settings"),
        Binding("f3", "app.models", "Models"),
    ]

    def __init__(self):
        super().__init__()
        self.conversation = Conversation()
        self.generation: Generation | None = None
        self._numbers = 0
        self._when_idle: list = []
        self.last_fragments: list[str] = []  # what the last reply's stream delivered, for tests
        self.ready = False  # the saved conversation is on screen
        self.map_baseline: list[list[int]] | None = None  # expert picks before this chat: the map shows the rest
        self.stats_wanted: bool | None = None  # None: shown when the screen is wide enough; else ctrl+t's choice
        self.decoding_warned = False  # the status line says speculation cannot run
        self._draft_timer: Timer | None = None
        self._draft_text = ""  # the input box's text as of its last change
        self._draft_saved: str | None = None  # what draft.json holds, as far as this screen knows
        self.read_only = ""  # why this window may not write the conversation on screen (another window has it)

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        # Set before the header mounts: a change while it mounts can reach it after a quick exit.
        self.sub_title = short_model_name(self.engine.name) if self.engine is not None else ""
        yield Header()
        with Horizontal(id="chat-body"):
            with Vertical(id="chat-column"):
                with VerticalScroll(id="messages"):
                    yield Static(self._empty_text(), id="empty-hint")
                yield Static("", id="chat-status", markup=False)
                yield PromptArea(placeholder="Message the model — Enter sends, ctrl+j new line, ↑ earlier prompts",
                                 id="prompt")
            yield StatsPanel(id="stats")
        yield Footer(compact=True)

    def _empty_text(self) -> Group:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", justify="right")
        keys.add_column(style="dim")
        for key, what in (("Enter", "send"), ("ctrl+j", "new line (shift+enter where the terminal tells it)"),
                          ("↑", "earlier prompts, in an empty box"), ("Esc", "stop the reply"),
                          ("ctrl+r", "write the last reply again"), ("ctrl+n", "new chat"), ("ctrl+o", "older chats"),
                          ("ctrl+y", "copy the last reply"), ("ctrl+t / F4", "show or hide stats / stats full screen"),
                          ("F2 / F3", "settings / models"),
                          ("ctrl+p", "all commands: copy code, rename, export, delete…")):
            keys.add_row(key, what)
        return Group(Text("Ask the model anything.\n", style="bold"), keys)

    @property
    def engine(self):
        return self.app.engine

    @property
    def messages(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    def on_screen_resume(self) -> None:
        # Whatever screen was on top (settings, models, a dialog), typing goes on in the message box.
        if self.is_mounted and self.query("#prompt"):
            self.prompt.focus()

    def on_key(self, event) -> None:
        """A character typed where nothing takes text (after a Tab, a closed panel) goes to the message box, not
        nowhere: dropped keys are lost words."""
        from textual.widgets import Input

        if event.is_printable and event.character and not isinstance(self.focused, (Input, TextArea)):
            event.stop()
            event.prevent_default()
            self.prompt.focus()
            self.prompt.insert(event.character)

    @property
    def prompt(self) -> PromptArea:
        return self.query_one("#prompt", PromptArea)

    @property
    def stats(self) -> StatsPanel:
        return self.query_one(StatsPanel)

    async def on_mount(self) -> None:
        self._place_stats()
        self.engine_changed()
        latest = self.app.store.latest()
        await self.show_conversation(latest or Conversation())
        self.show_decoding()
        self._restore_draft()
        self.prompt.focus()
        self.ready = True
        self._set_aside_unreadable()

    # ------------------------------------------------------------------ the unsent message

    def _restore_draft(self) -> None:
        self.app.store.claim_draft()
        text, problem = self.app.store.load_draft()
        if problem:
            self.notify(problem, title="unsent message", severity="warning", timeout=10)
        self._draft_saved = text if not problem else None
        if text and not self.prompt.text:
            self._draft_text = text
            self.prompt.text = text
            self.prompt.move_cursor(self.prompt.document.end)

    @on(TextArea.Changed, "#prompt")
    def _draft_changed(self, event: TextArea.Changed) -> None:
        self._draft_text = event.text_area.text
        if self._draft_timer is None:  # not reset by later keys: typing without a pause is saved too
            self._draft_timer = self.set_timer(self.DRAFT_SAVE_S, self.save_draft)

    def save_draft(self) -> None:
        """Write the unsent message now if draft.json does not hold it yet."""
        if self._draft_timer is not None:
            self._draft_timer.stop()
            self._draft_timer = None
        text = self._draft_text
        if text == self._draft_saved:
            return
        try:
            self.app.store.save_draft(text)
        except OSError as e:
            self.set_status(f"could not keep the unsent message: {one_line(e)}", error=True)
            return
        self._draft_saved = text

    def on_screen_suspend(self) -> None:
        self.save_draft()

    def on_unmount(self) -> None:
        self.save_draft()  # the app closing by any other way than ctrl+q
        self.app.store.close()  # now, not when the store is collected: another window may take the chat over

    @work(thread=True, group="set-aside", exit_on_error=False)
    def _set_aside_unreadable(self) -> None:
        """Report conversation files that cannot be read, and set them aside (a thread: every file is parsed)."""
        for problem in self.app.store.set_aside_unreadable():
            self.app.call_from_thread(self.notify, problem, title="conversations", severity="warning", timeout=15)

    def engine_changed(self) -> None:
        """A model was loaded (or released): refresh what depends on it."""
        engine = self.engine
        if engine is None:
            self.stats.set_model("no model loaded\nF3: choose one", 0, None)
            self.stats.update_map([], [])
            self.sub_title = ""
            return
        self.sub_title = short_model_name(engine.name)
        self.stats.set_model(model_summary(engine), engine.context_length, moe_layer_labels(engine),
                             engine.device.type, *row_devices(engine))
        heatmap = self.stats.heatmap
        heatmap.count_every, heatmap.gpu_count_every, heatmap.counted = count_sample(engine)
        self.map_baseline = None  # another model's counts
        self.refresh_map()
        if self.ready:
            self.show_decoding()

    def decoding(self, engine):
        """(how replies decode, a note when speculation was asked for but cannot run): Engine.stream's
        `decoding` from the settings and this run's flags."""
        settings = self.app.reply_settings()
        try:
            return settings.decoding(engine), ""
        except Exception as e:  # noqa: BLE001 -- MoedeskError (no draft head), or anything else: one line
            return None, f"{one_line(e)} · F2 sets a Draft head · replies decode without speculation"

    def show_decoding(self) -> None:
        """Say at once, not at the first reply, when the settings ask for speculation the model cannot do."""
        if self.engine is None or self.generation is not None:
            return
        _, note = self.decoding(self.engine)
        if note:
            self.set_status(note, error=True)
        elif self.decoding_warned:  # the settings changed and speculation can run now: the warning goes
            self.set_status("")
        self.decoding_warned = bool(note)

    def refresh_map(self) -> None:
        if self.engine is None:
            return
        try:
            on_gpu, popularity = self.engine.expert_map()
        except Exception as e:  # noqa: BLE001 - a map is not worth a crash
            self.set_status(f"expert map unavailable: {one_line(e)}", error=True)
            return
        base = self.map_baseline
        if base is not None and [len(row) for row in base] == [len(row) for row in popularity]:
            popularity = [[max(0, n - b) for n, b in zip(row, base_row)] for row, base_row in zip(popularity, base)]
        self.stats.update_map(on_gpu, popularity)

    def reset_map(self) -> None:
        """Count expert picks from now on: the engine counts since it loaded, the map belongs to this chat."""
        if self.engine is None:
            return
        try:
            self.map_baseline = [list(row) for row in self.engine.expert_map()[1]]
        except Exception:  # noqa: BLE001 - refresh_map reports it
            self.map_baseline = None
        self.refresh_map()

    def set_status(self, text: str, error: bool = False) -> None:
        status = self.query_one("#chat-status", Static)
        status.update(text)
        status.set_class(error, "-error")
        status.set_class(bool(text), "-shown")

    # ------------------------------------------------------------------ conversations

    def _hold(self, conversation: Conversation) -> Conversation:
        """Become the one writer of `conversation` if no other window is (`read_only` says why not), and return
        its newest saved copy: another window may have added turns since it was read. A new, unsaved chat is
        held from its first save."""
        store = self.app.store
        if not store.path(conversation.id).exists():
            store.let_go()
            self.read_only = ""
            return conversation
        self.read_only = store.hold(conversation.id)
        if self.read_only:
            return conversation
        try:
            return store.load(conversation.id)
        except (OSError, ValueError):
            return conversation

    async def _take_over(self) -> bool:
        """Before writing a read-only conversation: hold it if its other window has let go (then show its
        newest copy), else say so. True when this window may write it now."""
        if not self.read_only:
            return True
        old = self.conversation
        newest = self._hold(old)
        if self.read_only:
            self.set_status(f"{self.read_only}: not sent · ctrl+n new chat",
                            error=True)
            return False
        if newest is not old:
            await self.show_conversation(newest)
        return True

    async def show_conversation(self, conversation: Conversation) -> None:
        conversation = self._hold(conversation)
        self.conversation = conversation
        widgets = []
        for m in conversation.messages:
            if m.role == "user":
                widgets.append(UserMessage(m.content))
                self.prompt.remember(m.content)
            elif m.role == "assistant":
                widgets.append(AssistantMessage(m.content, m.meta, title=self._reply_title(m.meta)))
        messages = self.messages
        with self.app.batch_update():
            await messages.query("UserMessage, AssistantMessage").remove()
            if widgets:
                await messages.mount_all(widgets)
        self._update_empty()
        last = conversation.last("assistant")
        self.reset_map()
        self.stats.show_reply(last.meta if last else None, self._context_used(last))
        self.stats.set_speed_history(self._speed_history())
        self.set_status(f"{self.read_only}: read-only · ctrl+n new chat" if self.read_only else "",
                        error=bool(self.read_only))
        if self.read_only:
            self.notify(f"{self.read_only}: it is read-only here. ctrl+n starts a new chat.",
                        title="conversation", severity="warning", timeout=10)
        messages.anchor()  # stay on the newest message while replies stream in

    def _reply_title(self, meta: dict) -> str:
        model = meta.get("model")
        return short_model_name(model) if model else "assistant"

    def _context_used(self, last) -> int:
        if last is None:
            return 0
        return int(last.meta.get("prompt_tokens") or 0) + int(last.meta.get("tokens") or 0)

    def _speed_history(self) -> list[float]:
        speeds = []
        for m in self.conversation.messages:
            speed = (m.meta.get("stats") or {}).get("decode_tok_s") if m.role == "assistant" else None
            if isinstance(speed, (int, float)):
                speeds.append(float(speed))
        return speeds

    def _update_empty(self) -> None:
        self.query_one("#empty-hint").display = not self.conversation.messages

    def save(self) -> None:
        if not self.conversation.messages:
            return
        if self.read_only:  # callers take it over first (`_take_over`); a stale copy is never written
            self.set_status(f"{self.read_only}: not saved here", error=True)
            return
        if self.engine is not None and not self.conversation.model:
            self.conversation.model = self.engine.name
        try:
            if not self.read_only:  # a new chat is held from its first save on
                self.app.store.hold(self.conversation.id)
            self.app.store.save(self.conversation)
            self.app.store.remember(self.conversation.id)
        except OSError as e:
            self.set_status(f"could not save the conversation: {one_line(e)}", error=True)

    # ------------------------------------------------------------------ sending and streaming

    @on(PromptArea.Submitted, "#prompt")
    async def send_from_input(self, event: PromptArea.Submitted) -> None:
        text = event.text.strip("\n")
        if not text.strip():
            return
        if self.generation is not None:
            self.notify("A reply is still being written: Esc stops it.", severity="warning")
            return
        if self.engine is None:
            self.set_status("No model loaded: press F3 to choose one.", error=True)
            return
        if not await self._take_over():
            return
        too_long = self._too_long(self.engine, text)
        if too_long:  # it could never be answered: it stays in the box to be shortened, out of the conversation
            self.set_status(f"{too_long} · shorten it: it is still in the box", error=True)
            return
        event.prompt_area.text = ""
        self._draft_text = ""
        await self.send(text)
        self.save_draft()  # after the conversation is saved with the message: never neither, at worst both

    async def send(self, text: str) -> None:
        """Add the user's message and start the reply."""
        self.conversation.add("user", text)
        self.prompt.remember(text)
        self.save()
        await self._drop_failed_replies()
        await self.messages.mount(UserMessage(text))
        self._update_empty()
        await self.start_reply()

    async def _drop_failed_replies(self) -> None:
        await self.messages.query("AssistantMessage.-error").remove()

    def _too_long(self, engine, text: str) -> str:
        """Why `text` alone, with the system prompt, leaves no room for a reply in the context ('' if it does)."""
        if getattr(engine, "tokenizer", None) is None:
            return ""  # start_reply says that the model cannot chat
        system = self.app.settings.system_prompt
        turns = [{"role": "system", "content": system}] if system.strip() else []
        turns.append({"role": "user", "content": text})
        try:
            n = len(engine.tokenizer.chat_prompt(turns, **self.app.settings.template_options()))
        except Exception:  # noqa: BLE001 - the template's error is start_reply's to show
            return ""
        if n < engine.context_length:
            return ""
        return f"the message is {n:,} tokens; the model's context holds {engine.context_length:,}"

    def _prompt_ids(self, engine) -> tuple[list[int], int]:
        """Token ids of the conversation through the chat template; the oldest turns are left out
        when it would not leave room for the reply. Returns (ids, number of messages left out); sets
        `_in_reasoning`, whether the prompt leaves the reply inside an open think tag."""
        if engine.tokenizer is None:
            from moedesk.engine.errors import MoedeskError
            raise MoedeskError(f"{engine.name}: the model has no tokenizer, so it cannot chat")
        settings = self.app.settings
        history = self.conversation.messages
        system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt.strip() else []
        limit = engine.context_length - min(settings.max_new_tokens, engine.context_length // 2)
        start = 0
        while True:
            turns = [{"role": m.role, "content": m.content} for m in history[start:]]
            text = engine.tokenizer.render_chat(system + turns, **settings.template_options())
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            self._in_reasoning = starts_in_reasoning(engine.tokenizer.reply_format, text)
            if len(ids) <= limit:
                return ids, start
            later = next((i for i in range(start + 1, len(history)) if history[i].role == "user"), None)
            if later is None:
                break
            start = later
        if len(ids) >= engine.context_length:
            from moedesk.engine.errors import MoedeskError
            raise MoedeskError(f"the message is {len(ids):,} tokens; the model's context holds "
                               f"{engine.context_length:,}")
        return ids, start

    async def start_reply(self) -> None:
        engine = self.engine
        if engine is None:
            self.set_status("No model loaded: press F3 to choose one.", error=True)
            return
        try:
            prompt_ids, left_out = self._prompt_ids(engine)
        except Exception as e:  # noqa: BLE001 - MoedeskError from the template, or anything else: one line
            self.set_status(one_line(e), error=True)
            return
        settings = self.app.reply_settings()
        try:
            params = settings.sampling_params(seed=random.randrange(2**31),
                                              model_defaults=getattr(engine, "generation_defaults", None))
        except ValueError as e:
            self.set_status(f"settings: {e}", error=True)
            return
        decoding, decoding_note = self.decoding(engine)
        widget = AssistantMessage(title=short_model_name(engine.name), streaming=True)
        self._numbers += 1
        generation = Generation(self._numbers, threading.Event(), widget, len(prompt_ids), time.monotonic())
        self.generation = generation
        self.last_fragments = generation.fragments
        self.messages.anchor()
        await self.messages.mount(widget)
        note = f" · {left_out} oldest messages left out to fit the context" if left_out else ""
        note += f" · {decoding_note}" if decoding_note else ""
        generation.status = f"{writing(decoding)} Esc stops{note}"
        self.set_status(generation.status)
        self.stats.show_live(0, 0.0, len(prompt_ids))
        self.refresh_bindings()
        reader = ReplyStream(engine.tokenizer.reply_format, in_reasoning=self._in_reasoning, tools=False)
        self._generate(generation.number, engine, prompt_ids, params, generation.cancel, decoding, reader)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate(self, number: int, engine, prompt_ids: list[int], params, cancel: threading.Event,
                  decoding, reader: ReplyStream) -> None:
        pending: list[str] = []
        thoughts: list[str] = []  # reasoning not posted yet
        text, raw_text = "", ""
        tokens = 0
        posted_at = 0.0
        # Harmony's channels are special tokens: its replies are read from text that keeps them, a token at a time.
        raw = reader.fmt.keeps_special_tokens
        decoder = engine.tokenizer.stream_decoder(skip_special_tokens=False) if raw else None

        try:
            self._measure_for_auto(number, engine, decoding)
            extra = {"decoding": decoding} if decoding is not None else {}  # plain replies call stream as ever
            for chunk in engine.stream(prompt_ids, params, cancel=cancel, **extra):
                tokens += len(chunk.token_ids)
                text += chunk.text
                if raw:
                    raw_text += "".join(decoder.step(i) for i in chunk.token_ids)
                if chunk.completion is not None:
                    done = chunk.completion
                    final = engine.tokenizer.decode(done.token_ids, skip_special_tokens=False) if raw else done.text
                    piece = reader.update(final, final=True)
                    whole = parse_reply(final, reader.fmt, in_reasoning=reader.in_reasoning, tools=False)
                    self.post_message(ReplyDone(number, done, "".join(pending) + piece.content, whole.content,
                                                whole.reasoning, "".join(thoughts) + piece.reasoning))
                    return
                if chunk.text or raw:
                    piece = reader.update(raw_text if raw else text)
                    pending.append(piece.content)
                    thoughts.append(piece.reasoning)
                now = time.monotonic()
                if (any(pending) or any(thoughts)) and now - posted_at >= self.STREAM_INTERVAL_S:
                    self.post_message(ReplyDelta(number, "".join(pending), tokens, "".join(thoughts)))
                    pending.clear()
                    thoughts.clear()
                    posted_at = now
            self.post_message(ReplyFailed(number, "the engine ended the reply without a result", "".join(pending)))
        except BaseException as e:  # noqa: BLE001 - shown as one line; the UI goes on
            self.post_message(ReplyFailed(number, one_line(e), "".join(pending)))

    def _measure_for_auto(self, number: int, engine, decoding) -> None:
        """auto's first reply on this machine measures its step times first (about half a minute on a CPU): done
        here, with progress on the status line, not inside the reply's first step where it looked like a hang."""
        step_times = getattr(engine, "speculation_step_times", None)
        if getattr(decoding, "mode", None) != "auto" or step_times is None \
                or step_times(decoding.draft_length) is not None:
            return
        self.post_message(Measuring(number, 0.0))
        step_times(decoding.draft_length, measure=True, progress=lambda done: self.post_message(Measuring(number, done)))

    def on_measuring(self, message: Measuring) -> None:
        g = self._current(message.generation)
        if g is None:
            return
        if message.done >= 1.0:
            self.set_status(g.status)
        else:
            # short enough for 80 columns, the share last but one: it must not be cut off
            self.set_status(f"auto measures this machine's steps, once: {message.done:.0%} · then it replies")

    def _current(self, number: int) -> Generation | None:
        g = self.generation
        return g if g is not None and g.number == number else None

    async def on_reply_delta(self, message: ReplyDelta) -> None:
        g = self._current(message.generation)
        if g is None:
            return
        if message.text:
            g.fragments.append(message.text)
        g.tokens = message.tokens
        await g.widget.append_reasoning(message.reasoning)
        await g.widget.append(message.text)
        now = time.monotonic()
        self.stats.show_live(g.tokens, now - g.started, g.prompt_tokens + g.tokens)
        if now - g.map_shown_at >= MAP_REFRESH_S:
            g.map_shown_at = now
            self.refresh_map()

    async def on_reply_done(self, message: ReplyDone) -> None:
        g = self._current(message.generation)
        if g is None:
            return
        if message.tail:
            g.fragments.append(message.tail)
        c = message.completion
        meta = {"finish_reason": c.finish_reason, "tokens": len(c.token_ids), "prompt_tokens": c.prompt_tokens,
                "stats": dict(c.stats or {}), "model": self.engine.name if self.engine is not None else ""}
        if message.reasoning:
            meta["reasoning"] = message.reasoning  # kept beside the answer; later turns send the answer only
        if c.finish_reason == "cancelled" and not c.text:
            await g.widget.remove()  # stopped before the first word: nothing worth keeping
        else:
            await g.widget.finish(message.answer, meta)
            self.conversation.add("assistant", message.answer, **meta)
            self.save()
            self.stats.show_reply(meta, c.prompt_tokens + len(c.token_ids))
            self.stats.set_speed_history(self._speed_history())
        self._finished("stopped" if c.finish_reason == "cancelled" else "")

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        g = self._current(message.generation)
        if g is None:
            return
        # What was written before the failure stays on screen (not in the conversation: the model never
        # finished it); the user's message is saved, so ctrl+r writes the reply again.
        partial = g.widget.text + message.tail
        if message.tail:
            g.fragments.append(message.tail)
        await g.widget.finish(partial, {"error": message.error})
        self._finished(f"{message.error} · ctrl+r tries again", error=True)

    def _finished(self, status: str, error: bool = False) -> None:
        self.generation = None
        self.refresh_map()
        self.set_status(status, error=error)
        self.refresh_bindings()
        actions, self._when_idle = self._when_idle, []
        for action in actions:
            self.call_later(action)

    def keep_reply_so_far(self) -> None:
        """On quit: save the reply being written as stopped, since the app does not wait for the engine to end it."""
        g = self.generation
        if g is None:
            return
        g.cancel.set()
        self.generation = None  # whatever the worker still posts is dropped
        if g.widget.text:
            self.conversation.add("assistant", g.widget.text, finish_reason="cancelled", tokens=g.tokens,
                                  prompt_tokens=g.prompt_tokens, stats={},
                                  model=self.engine.name if self.engine is not None else "")
            self.save()

    def stop_generation(self, then=None) -> bool:
        """Ask the running reply to stop; `then` runs once it has. False when nothing was running."""
        if self.generation is None:
            if then is not None:
                self.call_later(then)
            return False
        self.generation.cancel.set()
        if then is not None:
            self._when_idle.append(then)
        return True

    # ------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return self.generation is not None  # hidden while idle: the footer's room goes to Quit
        return True

    def action_stop(self) -> None:
        if self.stop_generation():
            self.set_status("stopping…")

    async def action_regenerate(self) -> None:
        if self.generation is not None:
            self.stop_generation(then=self.action_regenerate)
            return
        if not await self._take_over():
            return
        history = self.conversation.messages
        if history and history[-1].role == "assistant":
            history.pop()
            replies = self.messages.query(AssistantMessage)
            if replies:
                await replies.last().remove()
        await self._drop_failed_replies()
        if not history or history[-1].role != "user":
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self.save()
        await self.start_reply()

    async def action_new_chat(self) -> None:
        if self.generation is not None:
            self.stop_generation(then=self.action_new_chat)
            return
        self.app.store.remember(None)
        await self.show_conversation(Conversation())
        self.prompt.focus()

    def action_copy_reply(self) -> None:
        last = self.conversation.last("assistant")
        if last is None or not last.content:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self._copy(last.content, "the last reply")

    def action_copy_code(self) -> None:
        from moedesk.app.tui.clipboard import last_code_block

        reply = next((m for m in reversed(self.conversation.messages)
                      if m.role == "assistant" and last_code_block(m.content) is not None), None)
        if reply is None:
            self.notify("No code block in the replies to copy.", severity="warning")
            return
        self._copy(last_code_block(reply.content), "the last code block")

    def _copy(self, text: str, what: str) -> None:
        from moedesk.app.tui.clipboard import OSC52_NOTE, copy_text

        how = copy_text(self.app, text)
        size = f"{len(text):,} characters"
        if how:
            self.notify(f"Copied {what} ({size}) {how}.")
        else:
            self.notify(f"{what[0].upper()}{what[1:]} ({size}) was {OSC52_NOTE}.", title="no system clipboard",
                        severity="warning", timeout=10)

    def on_resize(self, event) -> None:
        self._place_stats()

    def _place_stats(self) -> None:
        if self.maximized is self.stats:
            return
        shown = self.stats_wanted if self.stats_wanted is not None else self.size.width >= self.STATS_AUTO_WIDTH
        self.stats.set_class(not shown, "-hidden")

    def action_rename(self) -> None:
        from moedesk.app.tui.screens.dialogs import AskScreen

        if not self.conversation.messages:
            self.notify("Nothing to rename yet: an empty chat is not saved.", severity="warning")
            return

        async def renamed(title: str | None) -> None:
            if title and await self._take_over():
                self.conversation.title = title
                self.save()
                self.notify(f"Renamed to “{title}”.")

        self.app.push_screen(AskScreen("Rename this chat", self.conversation.title), renamed)

    def action_export(self) -> None:
        from moedesk.app.tui.screens.dialogs import AskScreen
        from moedesk.app.tui.storage import export_file_name, export_folder

        if not self.conversation.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return
        default = export_folder() / export_file_name(self.conversation)
        self.app.push_screen(AskScreen("Export this chat as Markdown to", str(default),
                                       "Enter writes the file (an existing one is replaced) · Esc cancels"),
                             self._export_to)

    def _export_to(self, path: str | None) -> None:
        from pathlib import Path

        from moedesk.app.tui.storage import conversation_markdown

        if not path:
            return
        target = Path(path).expanduser()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(conversation_markdown(self.conversation), encoding="utf-8")
        except OSError as e:
            self.set_status(f"could not export: {one_line(e)}", error=True)
            return
        self.notify(f"Exported to {target}")

    def action_delete_chat(self) -> None:
        from moedesk.app.tui.screens.dialogs import ConfirmScreen

        if not self.conversation.messages:
            self.notify("Nothing to delete: this chat is empty.", severity="warning")
            return
        turns = sum(m.role == "user" for m in self.conversation.messages)
        question = (f"Delete “{self.conversation.title or 'this chat'}” ({turns} exchange{'s' if turns != 1 else ''})?"
                    " This cannot be undone.")

        async def answered(yes: bool | None) -> None:
            if not yes:
                return
            if self.generation is not None:
                self.stop_generation(then=lambda: answered(True))
                return
            try:
                self.app.store.delete(self.conversation.id)
            except OSError as e:
                self.set_status(f"could not delete: {one_line(e)}", error=True)
                return
            self.notify(f"Deleted “{self.conversation.title}”.")
            await self.action_new_chat()

        self.app.push_screen(ConfirmScreen(question, yes="Delete", no="Keep"), answered)

    def action_toggle_stats(self) -> None:
        if self.maximized is not None:
            self.minimize()
        self.stats_wanted = self.stats.has_class("-hidden")
        self._place_stats()

    def action_maximize_stats(self) -> None:
        if self.maximized is self.stats:
            self.minimize()
            self._place_stats()
            self.prompt.focus()
        else:
            self.stats.remove_class("-hidden")
            self.maximize(self.stats, container=False)

    def action_conversations(self) -> None:
        from moedesk.app.tui.screens.conversations import ConversationsScreen

        self.app.push_screen(ConversationsScreen(self.app.store, self.conversation.id), self._open_chosen)

    async def _open_chosen(self, conversation_id: str | None) -> None:
        if conversation_id is not None:
            await self.open_conversation(conversation_id)
        elif self.conversation.messages and not self.app.store.path(self.conversation.id).exists():
            await self.action_new_chat()  # the open chat was deleted in the picker

    async def open_conversation(self, conversation_id: str) -> None:
        if self.generation is not None:
            self.stop_generation(then=lambda: self.open_conversation(conversation_id))
            return
        try:
            conversation = self.app.store.load(conversation_id)
        except (OSError, ValueError) as e:
            self.set_status(f"cannot open that conversation: {one_line(e)}", error=True)
            return
        self.app.store.remember(conversation.id)
        await self.show_conversation(conversation)
