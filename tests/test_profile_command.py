"""`moedesk profile` on a tiny model: hardware, a cached latency profile, popularity, a placement within budget."""
import re

from app.cli import main


def test_profile_prints_hardware_latency_and_placement(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = str(tiny_checkpoint("mixtral"))
    args = ["profile", "--model", folder, "--device", "cpu", "--dtype", "float32", "--gpu-budget", "0.0001"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "RAM" in out and "CPU" in out
    assert "CPU experts: " in out  # which code computes CPU experts here
    assert re.search(r"^\s+256\s+\d", out, re.M)  # latency table reaches 256 tokens
    placed = re.search(r"(\d+) of 12 experts on the GPU", out)
    expert_bytes = 3 * 64 * 48 * 4
    assert placed and int(placed.group(1)) == int(0.0001 * 2**30) // expert_bytes
    rows = re.findall(r"layer\s+\d+: ([.G]+)", out)
    assert len(rows) == 3 and sum(r.count("G") for r in rows) == int(placed.group(1))
    even = re.search(r"popularity: (\d+)% even routing", out)
    assert even and 0 <= int(even.group(1)) <= 100
    assert "whole layers" not in out  # two experts: no layer whole
    cached = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.json"))
    assert cached == ["popularity", "profile"]
    assert main(args) == 0  # second run reads the cache
    assert capsys.readouterr().out.count("experts on the GPU") == 1
    args[-1] = "1"  # room for every expert
    assert main(args) == 0
    assert "3 whole layers on the GPU (run inside the decode graphs)" in capsys.readouterr().out
