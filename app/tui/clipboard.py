"""Copying text out of the app: the system clipboard where a tool for it is reachable, else the terminal.

Textual's `copy_to_clipboard` only writes an OSC 52 escape sequence, which many terminals (and tmux
without `set-clipboard on`) ignore without a word, so "Copied" was not always true. The system tools
are what clipboard libraries run too; calling them directly needs no dependency. Over SSH without a
forwarded display, a tool would fill the remote machine's clipboard, so OSC 52 is the way there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from markdown_it import MarkdownIt


@dataclass(frozen=True)
class Tool:
    name: str
    argv: tuple[str, ...]
    encoding: str = "utf-8"

    def usable(self) -> bool:
        return shutil.which(self.argv[0]) is not None


def candidate_tools(env=None, platform: str | None = None) -> list[Tool]:
    """The clipboard tools worth trying here, best first."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    tools = []
    if platform == "darwin":
        tools.append(Tool("pbcopy", ("pbcopy",)))
    if platform.startswith("win") or "WSL_DISTRO_NAME" in env:
        tools.append(Tool("clip.exe", ("clip.exe",), "utf-16"))  # reads UTF-16 with a BOM as Unicode
    if env.get("WAYLAND_DISPLAY"):
        tools.append(Tool("wl-copy", ("wl-copy",)))
    if env.get("DISPLAY"):
        tools.append(Tool("xclip", ("xclip", "-selection", "clipboard")))
        tools.append(Tool("xsel", ("xsel", "--clipboard", "--input")))
    if env.get("TERMUX_VERSION"):
        tools.append(Tool("termux-clipboard-set", ("termux-clipboard-set",)))
    return tools


def tools_here() -> list[Tool]:
    return candidate_tools()


def system_copy(text: str) -> str | None:
    """Put `text` on the system clipboard; the tool's name when one took it, None when none could."""
    for tool in tools_here():
        if not tool.usable():
            continue
        try:
            # The tools that keep owning the selection (xclip, wl-copy) fork; with no pipes left open, run() returns.
            subprocess.run(tool.argv, input=text.encode(tool.encoding), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=3, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        return tool.name
    return None


def copy_text(app, text: str) -> str:
    """Copy through the system clipboard if possible, and through the terminal always (so that pasting
    inside the app works too). Returns how, in words for a notification."""
    app.copy_to_clipboard(text)
    tool = system_copy(text)
    if tool is not None:
        return f"to the system clipboard ({tool})"
    return ""


OSC52_NOTE = ("sent to the terminal (OSC 52), which may ignore it: if pasting gives nothing, turn on clipboard "
              "access in the terminal (tmux: set -g set-clipboard on)")


def last_code_block(markdown: str) -> str | None:
    """The content of the last fenced or indented code block, without its fence; None when there is none."""
    blocks = [t.content for t in MarkdownIt("commonmark").parse(markdown) if t.type in ("fence", "code_block")]
    return blocks[-1] if blocks else None
