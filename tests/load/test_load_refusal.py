"""A model larger than the memory this process may use is refused in one line before its weights are read, whether
the machine's RAM or a cgroup's memory.max is what is short (issue 42, item 4). The cgroup is a fake one, laid out
as the kernel lays out cgroup v2, which engine.host_memory is pointed at; psutil's RAM is replaced likewise."""
from __future__ import annotations

import psutil
import pytest

import moedesk.engine.host_memory as host_memory
import moedesk.engine.runtime as runtime
from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.engine.load.size_estimate import summarize_path
from tests.load.test_gguf_checkpoint import write_tiny_mixtral

GIB = 2**30


class _Memory:
    def __init__(self, available: int):
        self.available = available
        self.total = max(available, 64 * GIB)


@pytest.fixture(params=["gguf", "safetensors"])
def checkpoint(request, tmp_path, tiny_checkpoint):
    if request.param == "safetensors":
        return tiny_checkpoint("mixtral")
    path = tmp_path / "tiny-mixtral.gguf"
    write_tiny_mixtral(path)
    return path


def limits(monkeypatch, tmp_path, ram: int, memory_max: int | None, current: int = 50 * 2**20) -> None:
    """psutil's available RAM, and a cgroup v2 "/app.slice" with this memory.max (None: "max") around the process."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(ram))
    root, own = tmp_path / "cgroup", tmp_path / "own-cgroup"
    (root / "app.slice").mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text("max\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "app.slice" / "memory.max").write_text(f"{'max' if memory_max is None else memory_max}\n")
    (root / "app.slice" / "memory.current").write_text(f"{current}\n")
    own.write_text("0::/app.slice\n")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_memory, "OWN_CGROUPS", own)


def need(path) -> int:
    return summarize_path(path).estimate("auto", "float32").ram_bytes(False)


def no_weights_read(monkeypatch) -> None:
    def read(*args, **kwargs):
        raise AssertionError("the weights were read before the memory was checked")

    monkeypatch.setattr(runtime, "load_model", read)


@pytest.mark.parametrize("short", ["ram", "cgroup"])
def test_a_load_that_does_not_fit_is_refused_before_reading_the_weights(checkpoint, tmp_path, monkeypatch, short):
    n = need(checkpoint)
    if short == "ram":
        limits(monkeypatch, tmp_path, ram=n // 2, memory_max=None)
    else:  # the machine has plenty; the group it runs in does not
        limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * 2**20 + n // 2)
    assert host_memory.available_memory() == n // 2
    no_weights_read(monkeypatch)
    with pytest.raises(MoedeskError) as refusal:
        runtime.Engine.load(str(checkpoint), device="cpu", dtype="float32")
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"{checkpoint} needs ") and "is available" in message


def test_the_command_says_it_in_one_line_and_loads_once_the_group_allows_it(checkpoint, tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n')
    args = ["batch", str(src), "-o", str(out), "--model", str(checkpoint), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "2"]
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * 2**20 + need(checkpoint) // 2)
    capsys.readouterr()
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moedesk: {checkpoint} needs "), lines
    assert not out.exists() or out.read_text() == ""
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=16 * GIB)  # the same machine, a roomier group
    assert main(args) == 0 and '"id": "a"' in out.read_text()


def test_the_models_screen_reads_the_groups_limit(tiny_checkpoint, tmp_path, monkeypatch):
    from moedesk.app.tui.catalog import LocalModel
    from moedesk.app.tui.load_target import LoadTarget
    from moedesk.app.tui.screens.models import memory_note

    folder = tiny_checkpoint("mixtral")
    model = LocalModel(str(folder), "tiny", "folder", 1000, "mixtral", 4, 2, weights=summarize_path(folder))
    target = LoadTarget("auto", "float32", False)
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=50 * 2**20 + need(folder) // 2)
    note = memory_note(model, target)
    assert "· does not fit: " in note and "\n" not in note
    limits(monkeypatch, tmp_path, ram=64 * GIB, memory_max=16 * GIB)
    assert "does not fit" not in memory_note(model, target)
