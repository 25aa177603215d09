"""The README documents every command-line option: each command's section names each of its flags."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from moedesk.app.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def section(command: str) -> str:
    """From the command's heading (`### \\`moedesk [chat] ...` for chat) to the next heading."""
    name = re.escape("[chat]" if command == "chat" else command)
    match = re.search(rf"^### `moedesk {name}[ `].*?(?=^##)", README, re.S | re.M)
    assert match, f"README has no section for `moedesk {command}`"
    return match.group(0)


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_option_is_in_its_readme_section(command):
    text = section(command)
    flags = [flag for action in commands()[command]._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"]
    assert flags or command == "chat"
    missing = [flag for flag in flags if not re.search(rf"`[^`]*{re.escape(flag)}\b", text)]
    assert not missing, f"README's `moedesk {command}` section does not mention {missing}"


def test_ci_finds_the_readme_commands_it_runs_as_written():
    # .ci/run runs these two lines in a fresh clone; a README rewrite that loses them must fail here, not in CI.
    import importlib.util

    path = Path(__file__).resolve().parents[1] / ".ci" / "readme_commands.py"
    spec = importlib.util.spec_from_file_location("readme_commands", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    install, test = module.readme_commands(README)
    assert "python3 -m venv .venv" in install and install.endswith("pip install -e .")
    assert test.startswith("pip install -e '.[test]'") and "pytest" in test
    with pytest.raises(ValueError):
        module.readme_commands("```bash\npip install -e .\n```\n")


def test_the_first_screen_says_how_to_install_without_an_nvidia_gpu():
    # Issue 46.2: pip on Linux takes CUDA torch (6 GB) even where no NVIDIA GPU can use it; the way around and
    # what it saves are said before a new user scrolls.
    first_screen = "\n".join(README.splitlines()[:40])
    assert "Without an NVIDIA GPU" in first_screen
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in first_screen
    assert re.search(r"\d+ GB environment", first_screen) and "minute install" in first_screen
