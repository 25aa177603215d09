"""The memory a process may use: the tightest cgroup limit above it (v2 and v1), read from cgroup file systems
laid out as the kernel lays them out; and the Models screen's note saying that a model will not fit."""
from __future__ import annotations

from pathlib import Path

from moedesk.engine.host_memory import available_memory, cgroup_room

GIB = 2**30


def write(folder: Path, **files) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(f"{text}\n")


def test_cgroup_v2_takes_the_tightest_limit_of_the_group_and_its_ancestors(tmp_path):
    write(tmp_path, memory_max="max", memory_current=str(5 * GIB))
    write(tmp_path / "user.slice", memory_max=str(20 * GIB), memory_current=str(4 * GIB))
    write(tmp_path / "user.slice" / "app.scope", memory_max="max", memory_current=str(1 * GIB))
    assert cgroup_room(tmp_path, "0::/user.slice/app.scope\n") == 16 * GIB
    write(tmp_path / "user.slice" / "app.scope", memory_max=str(2 * GIB), memory_current=str(1 * GIB))
    assert cgroup_room(tmp_path, "0::/user.slice/app.scope\n") == 1 * GIB
    write(tmp_path, memory_max="max", memory_current="0")  # a container sees its own group as "/"
    assert cgroup_room(tmp_path, "0::/\n") is None


def test_cgroup_v1_reads_the_memory_controller_and_ignores_its_no_limit_value(tmp_path):
    group = tmp_path / "memory" / "docker" / "abc"
    write(group, memory_limit_in_bytes=str(8 * GIB), memory_usage_in_bytes=str(3 * GIB))
    lines = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    assert cgroup_room(tmp_path, lines) == 5 * GIB
    write(group, memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(3 * GIB))
    assert cgroup_room(tmp_path, lines) is None
    assert cgroup_room(tmp_path / "nowhere", lines) is None  # nothing readable: no limit known


def test_available_memory_is_the_cgroup_room_when_it_is_below_the_ram(tmp_path, monkeypatch):
    import psutil

    class Memory:
        available = 30 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    own = tmp_path / "cgroup"
    own.write_text("0::/box\n")
    write(tmp_path / "fs" / "box", memory_max=str(12 * GIB), memory_current=str(2 * GIB))
    assert available_memory(tmp_path / "fs", own) == 10 * GIB
    write(tmp_path / "fs" / "box", memory_max=str(64 * GIB), memory_current=str(2 * GIB))
    assert available_memory(tmp_path / "fs", own) == 30 * GIB


def test_the_models_screen_says_a_model_bigger_than_the_memory_will_not_fit(tiny_checkpoint):
    from moedesk.app.tui.catalog import LocalModel
    from moedesk.app.tui.load_target import LoadTarget
    from moedesk.app.tui.screens.models import memory_note
    from moedesk.engine.load.size_estimate import summarize_path

    folder = tiny_checkpoint("mixtral")
    weights = summarize_path(folder)
    model = LocalModel(str(folder), "tiny", "folder", 1000, "mixtral", 4, 2, weights=weights)
    target = LoadTarget("auto", "float32", False)
    need = weights.estimate("auto", "float32").ram_bytes(False)
    assert "does not fit" not in memory_note(model, target, available=need * 2)
    note = memory_note(model, target, available=need)
    assert "· does not fit: " in note and note.count("\n") == 0


def test_batch_sizes_its_kv_cache_on_the_cpu_within_the_cgroup(monkeypatch):
    import torch

    import moedesk.engine.host_memory as host_memory
    from moedesk.app.batch import free_memory_bytes

    monkeypatch.setattr(host_memory, "cgroup_room", lambda root, membership: 3 * 2**20)
    assert free_memory_bytes(torch.device("cpu")) == 3 * 2**20
