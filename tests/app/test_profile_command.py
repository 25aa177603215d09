"""`moedesk profile` on a tiny model: hardware, a cached latency profile, popularity, a placement within budget."""
import re

from moedesk.app.cli import main
from tests.tiny_models import budget_for_experts


def test_profile_prints_hardware_latency_and_placement(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = str(tiny_checkpoint("mixtral"))
    # Room for two experts beside the weights and the cache of the context (the budget is the whole GPU's).
    args = ["profile", "--model", folder, "--device", "cpu", "--dtype", "float32",
            "--gpu-budget", str(budget_for_experts(folder, 2))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "RAM" in out and "CPU" in out
    assert "CPU experts: " in out  # which code computes CPU experts here
    # A float32 model's experts: the native kernel computes bfloat16 ones, so it is not named as if it ran (#46.8).
    line = next(x for x in out.splitlines() if x.startswith("CPU experts: "))
    assert line.startswith("CPU experts: torch (float32 experts") and "native" in line and "bf16" not in line
    assert re.search(r"^\s+256\s+\d", out, re.M)  # latency table reaches 256 tokens
    assert re.search(r"tokens\s+CPU ms\s+in a call\s+GPU ms", out)
    latency = re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)\s+[\d.]+$", out, re.M)
    assert len(latency) == 5  # 1, 4, 16, 64 and 256 tokens
    for alone, share in latency:
        assert float(share) <= float(alone)  # one more expert in a call costs no more than a call of its own
    # Prefill loads priced from calls of several experts at them, on the one path unpacked experts have.
    assert re.search(r"^prefill loads: an expert's share of a CPU call on dense \(tokens: ms\) 8: [\d.]+ · 16: [\d.]+ · "
                     r"32: [\d.]+ · 64: [\d.]+$", out, re.M)
    placed = re.search(r"(\d+) of 12 experts on the GPU", out)
    assert placed and int(placed.group(1)) == 2
    assert "left free" not in out  # the CPU's simulated GPU splits no lone token: the plan fills its room
    assert re.search(r"^GPU budget [\d.]+ MiB: weights [\d.]+ MiB, KV cache of 512 positions [\d.]+ MiB, workspace", out,
                     re.M)  # where the budget went before the experts
    rows = [(int(first), int(last or first), row)
            for first, last, row in re.findall(r"layers?\s+(\d+)(?:-(\d+))?:\s+([.G]+)$", out, re.M)]
    assert [first for first, _, _ in rows][0] == 0 and rows[-1][1] == 2  # every layer, in runs
    assert sum((last - first + 1) * row.count("G") for first, last, row in rows) == int(placed.group(1))
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


def test_map_lines_join_layers_placed_alike():
    from moedesk.app.profile_command import map_lines

    assert map_lines([[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1], [0, 0]]) == [
        "  layers   0-1:   ..",
        "  layer    2:     G.",
        "  layers   3-5:   GG",
        "  layer    6:     ..",
    ]
    assert map_lines([]) == []
    assert map_lines([[1, 0, 1]] * 48) == ["  layers   0-47:  G.G"]


def test_zero_copy_line_shows_the_measured_splits_and_the_choice():
    from moedesk.app.profile_command import zero_copy_line
    from moedesk.engine.offload.assignment import lone_token_split
    from moedesk.engine.offload.latency_model import LatencyModel

    def line(costs, top_k):
        return zero_copy_line(costs, top_k, lone_token_split(top_k, costs))  # as the orchestra decides

    costs = LatencyModel(0.1, 0.01, 0.05, (1, 8), (0.2, 0.3), 0.2, zero_copy_split_ms=(0.69, 0.68, 0.6),
                         zero_copy_top_k=8)
    assert line(costs, 8) == ("one token's 8 experts, n of them read by the GPU from RAM (n: ms) "
                              "0: 0.690 · 1: 0.680 · 2: 0.600; decode reads 2 zero-copy")
    assert line(costs, 2).endswith("decode reads none zero-copy")  # measured for another top-k
    assert line(LatencyModel(0.1, 0.01, 0.05, (1, 8), (0.2, 0.3), 0.2), 8) is None
    # where the placement is known: the split runs only in layers with no expert resident
    chosen = lone_token_split(8, costs)
    assert zero_copy_line(costs, 8, chosen, 28).endswith("decode reads 2 zero-copy in the 28 layers with no expert on "
                                                         "the GPU")
    assert zero_copy_line(costs, 8, chosen, 0).endswith("decode reads 2 zero-copy, where a layer has no expert on the "
                                                        "GPU: none here")
    assert zero_copy_line(costs, 2, lone_token_split(2, costs), 28).endswith("decode reads none zero-copy")
    rows = LatencyModel(0.1, 0.01, 0.05, (1, 8), (0.2, 0.3), 0.2, zero_copy_split_ms=(1.46, 2.1), zero_copy_top_k=2,
                        split_width_ms=((1792, 1.3), (3584, 1.1)))
    assert line(rows, 2) == ("one token's 2 experts, n of them read by the GPU from RAM (n: ms) "
                             "0: 1.460 · 1: 2.100; or the last w of each one's width (w: ms) 1792: 1.300 · "
                             "3584: 1.100; decode splits the width, the GPU the last 3584")


def test_contention_line_shows_each_token_count():
    from moedesk.app.profile_command import contention_line
    from moedesk.engine.offload.latency_model import LatencyModel

    def costs(contention=()):
        return LatencyModel(0.1, 0.01, 0.05, (1, 8), (0.2, 0.3), 0.2, contention=contention)

    assert contention_line(costs(((1, 1.23, 1.07), (4, 1.1, 1.09), (16, 1.0, 1.08)))) == (
        "CPU experts and copies at once, slower by (tokens an expert: CPU, copies) "
        "1: x1.23, x1.07 · 4: x1.10, x1.09 · 16: x1.00, x1.08")
    assert contention_line(costs()) is None and contention_line(costs(((1, 1.0, 1.0),))) is None


def test_the_cpu_path_named_is_the_one_the_dispatch_takes():
    import torch

    from moedesk.kernels import cpu_experts, cpu_quant
    from moedesk.kernels.experts import cpu_path
    from moedesk.kernels.expert_weights import ExpertWeights

    def dense(dtype):
        return ExpertWeights(torch.zeros(2, 64, 32, dtype=dtype), torch.zeros(2, 32, 32, dtype=dtype), 32, 32)

    assert cpu_path(dense(torch.bfloat16)) == cpu_experts.describe()
    assert cpu_path(dense(torch.float32)).startswith("torch (float32 experts")
    packed = ExpertWeights.empty(2, 32, 32, dtype=torch.bfloat16, gate_up_format="q8_0", down_format="q8_0")
    assert cpu_path(packed) == cpu_quant.describe()
    biased = dense(torch.bfloat16).with_function(down_bias=torch.zeros(2, 32, dtype=torch.bfloat16))
    assert cpu_path(biased).startswith("torch (experts with biases")


def test_profile_prints_the_per_device_plan_of_several_budgets(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """Two simulated GPUs (the count detection sees is patched; on the CPU the CPU stands in for each): the model
    loads spread over them and the plan it runs is printed, device by device."""
    import moedesk.engine.hardware as hardware

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "cuda_device_count", lambda: 2)
    folder = str(tiny_checkpoint("mixtral"))
    args = ["profile", "--model", folder, "--device", "cpu", "--dtype", "float32", "--context", "64",
            "--gpu-budget", "0.01,0.01"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per-device plan over 2 GPUs, 1 device crossing(s) per token:" in out
    gpus = re.findall(r"^  GPU (\d): layers (\d)-(\d), ", out, re.M)
    assert [g[0] for g in gpus] == ["0", "1"]
    assert int(gpus[0][1]) == 0 and int(gpus[1][2]) == 2 and int(gpus[1][1]) == int(gpus[0][2]) + 1  # consecutive
    assert "planned only" not in out and "warning:" not in out
    assert re.search(r"^  GPU 1 \(cpu\): copies an expert in \d+\.\d+ ms", out, re.M)


def test_per_device_budgets_that_do_not_match_the_gpus_are_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    import moedesk.engine.hardware as hardware

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "cuda_device_count", lambda: 1)
    folder = str(tiny_checkpoint("mixtral"))
    assert main(["profile", "--model", folder, "--device", "cpu", "--gpu-budget", "16,16"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "names 2 GPUs and this machine has 1 CUDA GPU" in err


def test_gpu_budget_takes_one_figure_or_one_per_gpu(capsys):
    import pytest

    from moedesk.app.cli import build_parser

    parser = build_parser()
    one = parser.parse_args(["profile", "--gpu-budget", "16"]).gpu_budget
    assert one == 16.0 and isinstance(one, float)  # one GPU: exactly today's value
    assert parser.parse_args(["profile", "--gpu-budget", "16, 12.5"]).gpu_budget == (16.0, 12.5)
    for bad in ("16,x", "16,-1", "16,,16", "nan,16"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["profile", "--gpu-budget", bad])
        assert exit_.value.code == 2
        assert "--gpu-budget" in capsys.readouterr().err.strip().splitlines()[-1]


def test_placement_line_says_where_the_plan_left_room_free():
    from moedesk.app.profile_command import placement_line

    summary = {"gpu_budget_gib": 8.0, "experts_on_gpu": 2432, "experts_total": 6144, "experts_room": 2532,
               "expected_gpu_hit_rate": 0.4}
    assert placement_line(summary) == (
        "placement at 8.00 GiB: 2432 of 6144 experts on the GPU, expected GPU hit rate 40%; room for 100 more left "
        "free: a layer with no expert on the GPU shares a lone token with it, which the profile timed faster")
    full = dict(summary, experts_on_gpu=2532, expected_gpu_hit_rate=None)
    assert placement_line(full) == ("placement at 8.00 GiB: 2532 of 6144 experts on the GPU (no popularity: the model "
                                    "has no tokenizer)")


def test_budget_line_names_the_token_table_where_it_stays_in_ram():
    from moedesk.app.profile_command import budget_line
    from moedesk.engine.offload.gpu_budget import BudgetSplit

    split = BudgetSplit(budget=8 * 2**30, weights=2**29, kv_cache=2**20, workspace=2**21, slack=2**25,
                        experts=8 * 2**30 - 2**29 - 2**20 - 2**21 - 2**25, context=4096, rows=1)
    line = budget_line(split)
    assert line.startswith("GPU budget 8192.0 MiB: weights 512.0 MiB, KV cache of 4096 positions 1.0 MiB")
    assert "token table" not in line
    assert budget_line(split, 622 * 2**20) == line + "; the token table (622.0 MiB) in RAM, a row read a token"
