"""Shared pieces of the TUI tests: private folders, the real engine on a tiny model, waiting helpers.

Async tests run on anyio's pytest plugin (installed with anyio) on the asyncio backend.
"""
from __future__ import annotations

import pytest

from moedesk.engine.runtime import Engine


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def tui_dirs(tmp_path, monkeypatch):
    """Every TUI test gets its own data, config and models folders, and an empty Hugging Face cache."""
    dirs = {name: tmp_path / name for name in ("data", "config", "models", "hf-cache", "cache")}
    for path in dirs.values():
        path.mkdir()
    monkeypatch.setenv("MOEDESK_DATA_DIR", str(dirs["data"]))
    monkeypatch.setenv("MOEDESK_CONFIG_DIR", str(dirs["config"]))
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(dirs["models"]))
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(dirs["cache"]))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(dirs["hf-cache"]))
    return dirs


@pytest.fixture(autouse=True)
def no_system_clipboard(monkeypatch):
    """Tests never fill the developer's clipboard; those about it put their own stand-in tool here."""
    import moedesk.app.tui.clipboard as clipboard

    monkeypatch.setattr(clipboard, "tools_here", lambda: [])


@pytest.fixture(scope="session")
def tiny_folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture
def engine(tiny_folder):
    """A freshly loaded engine per test (loading the tiny model takes milliseconds), so expert counts
    and the cache never leak from one test into the next."""
    return Engine.load(str(tiny_folder), device="cpu", dtype="float32")
