"""tests/perf/profile_prefill.py: its layer kinds, its split of the device time inside the experts' calls, and the
whole script on the CPU (a tiny Qwen3.5 shape: Gated DeltaNet layers beside a full-attention one)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from moedesk.engine.load.synthetic import shape_config
from tests.perf import profile_prefill as pp


def test_each_layer_is_named_by_its_token_mixer_and_dense_layers_have_an_mlp_part():
    assert [pp.mixer_kind(shape_config("gpt-oss-120b", 4), i) for i in range(4)] == [
        "sliding", "attention", "sliding", "attention"]
    assert [pp.mixer_kind(shape_config("qwen3.5-35b-a3b", 4), i) for i in range(4)] == [
        "deltanet", "deltanet", "deltanet", "attention"]
    deepseek = shape_config("deepseek-v3", 4)  # three dense layers, then the MoE
    times = pp.LayerTimes(20.0, layer={0: 2.0, 1: 2.0, 2: 2.0, 3: 9.0}, mixer={0: 1.5, 1: 1.5, 2: 1.5, 3: 1.0},
                          experts={3: 6.0})
    assert pp.kind_split(deepseek, times) == {"mla": [4, 5.5], "mlp": [3, 1.5], "moe": [1, 8.0], "experts": [1, 6.0]}
    assert pp.issue_format("gpt-oss-120b") == "mxfp4" and pp.issue_format("qwen3.5-35b-a3b") == "q4_k"


def _event(name, kernels=(), children=()):
    return SimpleNamespace(name=name, kernels=[SimpleNamespace(name=n, duration=us) for n, us in kernels],
                           cpu_children=list(children))


def test_device_time_in_the_experts_calls_splits_into_expert_copies_other_transfers_and_kernels():
    """Memory copies under "prefill.copies" are the experts' weights; other copies (routing to the host, the CPU's
    results back) are transfers; a kernel launched straight under a range (Triton's) counts, the range's own
    span on the device does not; what lies outside the experts' ranges does not."""
    copies = _event("prefill.copies", [("prefill.copies", 900)],
                    [_event("aten::copy_", [("Memcpy HtoD (Pinned -> Device)", 400)]),
                     _event("aten::copy_", [("Memcpy HtoD (Pinned -> Device)", 350)])])
    experts = _event("prefill.experts", [("prefill.experts", 5000), ("_fused_moe_kernel", 120)],
                     [_event("aten::to", children=[_event("aten::copy_", [("Memcpy DtoH (Device -> Pageable)", 30)])]),
                      copies,
                      _event("aten::mm", [("sm90_xmma_gemm_bf16", 700)]),
                      _event("aten::copy_", [("Memcpy HtoD (Pinned -> Device)", 80)]),
                      _event("aten::index_copy_", [("index_copy_kernel", 20)])])
    outside = _event("prefill.deltanet", [], [_event("aten::mm", [("sm90_xmma_gemm_bf16", 999)])])
    split = pp.expert_device_ms([_event("prefill.layer", children=[outside, experts]), outside, experts, copies])
    assert split == pytest.approx({"copies": 0.75, "transfers": 0.11, "kernels": 0.84})


@pytest.mark.usefixtures("one_torch_thread")
def test_the_script_profiles_a_prefill_on_the_cpu_and_ends_with_one_row_a_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    [row] = pp.main(["tiny-qwen35:4", "--device", "cpu", "--tokens", "48", "--expert-format", "dense", "--rows", "30"])
    out = capsys.readouterr().out
    assert (tmp_path / "prefill-trace-tiny-qwen35.json.gz").stat().st_size > 0
    assert (tmp_path / "profile_prefill.txt").read_text().strip() == out.strip()
    # The profiler's table holds the marks' ranges, one row per part and mixer kind.
    assert all(f"prefill.{part}" in out for part in ("layer", "deltanet", "attention", "experts"))
    head, last = out.strip().splitlines()[-2:]
    assert head.split() == ["shape", "format", "tok/s", "ms", *pp.KINDS, "mlp", "moe", "experts", "cpu", "wait",
                            "copies", "gpu", "other"]
    cells = dict(zip(["shape", "format", "tok/s", "ms", *pp.KINDS, "mlp", "moe", "experts", "cpu", "wait",
                      "copies", "gpu", "other"], last.split()))
    assert cells["shape"] == "tiny-qwen35:4" and cells["format"] == "dense"
    # Three DeltaNet layers and one full attention, every layer MoE; no device time without a GPU.
    assert [cells[c] for c in ("sliding", "mla", "mlp", "copies", "gpu")] == ["-"] * 5
    assert float(cells["tok/s"]) == pytest.approx(row["tok/s"], abs=1) and row["tok/s"] > 0
    assert row["deltanet"] > 0 and row["attention"] > 0 and row["moe"] > row["experts"] > 0
    assert row["other"] > 0  # the layers ran inside the prefill's timed call: the embedding and head are the rest
    cpu, copied, resident = map(int, re.search(r"per prefill (\d+) experts on the CPU, (\d+) copied, (\d+) resident",
                                               out).groups())
    assert cpu + copied + resident > 0 and (cpu > 0) == (row["cpu"] > 0)
    # Each timed round on its own, with its host times: a round that stalls shows apart from the best.
    [rounds] = re.findall(r"the rounds, ms: (.*)", out)
    ms = [float(x) for x in re.findall(r"([\d.]+) \(queueing [\d.]+, CPU call [\d.]+\)", rounds)]
    assert len(ms) == 3 and min(ms) == pytest.approx(float(cells["ms"]), abs=0.1)
    # The outlook, priced from the marked prefill's own routing, makes the executor's splits.
    outlook = re.search(r"outlook from this prefill's routing .*?: (\d+) experts on the CPU, (\d+) copied \(the "
                        r"executor: (\d+), (\d+)\)", out)
    assert outlook and outlook.group(1, 2) == outlook.group(3, 4) and sum(map(int, outlook.group(1, 2))) > 0
    assert re.search(r"bounds on the \d+ offloaded experts it touched: the link alone [\d.]+ ms", out)


@pytest.mark.usefixtures("one_torch_thread")
def test_compare_measures_copies_one_by_one_then_grouped_on_one_build(tmp_path, monkeypatch, capsys):
    """--compare, on a replayed trace's routing (--routing): both measurements under the one replay."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    replays, replayed = [], pp.replayed

    def recorded(model, cfg, layers, routing, tokens, steps):
        replays.append((routing, tokens, steps, len(layers)))
        return replayed(model, cfg, layers, routing, tokens, steps)

    monkeypatch.setattr(pp, "replayed", recorded)
    rows = pp.main(["tiny-qwen35:4", "--device", "cpu", "--tokens", "48", "--expert-format", "dense", "--compare",
                    "--no-trace", "--routing", "no-locality"])
    out = capsys.readouterr().out
    assert replays == [("no-locality", 48, 6, 4)]
    assert [row["shape"] for row in rows] == ["tiny-qwen35:4/one-by-one", "tiny-qwen35:4/grouped"]
    assert all(row["tok/s"] > 0 and row["experts"] > 0 for row in rows)
    assert out.count("built tiny-qwen35") == 1 and "one by one: as before" in out and "grouped: one launch" in out
    assert [line.split()[0] for line in out.strip().splitlines()[-2:]] == [row["shape"] for row in rows]
    assert not list(tmp_path.glob("prefill-trace-*"))


def test_the_outlook_with_copies_ahead_prices_each_layer_as_the_executor_splits_it():
    """outlook_ahead (printed on the GPU only): each layer's loads and resident GPU time as outlook_of reads them, the
    next layer's expected loads from the calibrated popularity over its offloaded experts (expected_loads), the staging
    slots its own copies leave, and the executor's split options (here no overlap, copies one by one) throughout."""
    from moedesk.engine.offload.assignment import Costs
    from moedesk.engine.offload.prefill_outlook import prefill_outlook, prefill_outlook_ahead

    costs = Costs(cpu_ms=lambda n: 0.1 * n, gpu_ms=lambda n: 0.01 * n, copy_ms=2.0)
    bank = lambda resident: SimpleNamespace(gpu_slot=[0 if e in resident else None for e in range(4)],  # noqa: E731
                                            host=SimpleNamespace(hidden=8, width=8))
    executor = SimpleNamespace(banks={3: bank({0}), 5: bank({1})}, staging=[None] * 3, overlap_copies=False,
                               copy_runs=None)
    bench = SimpleNamespace(executor=executor, cfg=SimpleNamespace(num_experts_per_tok=2),
                            orchestra=SimpleNamespace(costs=costs, popularity=[[4, 3, 2, 1], [1, 1, 1, 1]]))
    counts = {3: [30, 20, 10, 0], 5: [5, 25, 15, 15]}
    layers = [({1: 20, 2: 10}, costs.gpu_expert_ms(30)), ({0: 5, 2: 15, 3: 15}, costs.gpu_expert_ms(25))]
    options = {"overlap": False, "grouped_copies": False}
    outlook, by_layer, touched = pp.outlook_of(bench, counts, tokens=30)
    assert outlook == prefill_outlook(layers, costs, 30, 0.0, **options) and sorted(by_layer) == [3, 5]
    assert sorted(touched) == [5, 10, 15, 15, 20]
    expected = [{1: 18.0, 2: 12.0, 3: 6.0}, {0: 15.0, 2: 15.0, 3: 15.0}]  # 30 tokens x top-2 by popularity
    # the three staging slots, of which each layer's own copies take theirs (as the executor copies ahead)
    assert pp.outlook_ahead(bench, counts, tokens=30, fixed_ms=4.0) == prefill_outlook_ahead(
        layers, expected, costs, 30, 4.0, 3, **options)
