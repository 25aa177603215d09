"""tests/perf/quant_targets.py reads one compare_quant_targets.sh run's files and judges each target by its ratio."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "perf" / "quant_targets.py"
spec = importlib.util.spec_from_file_location("quant_targets", SCRIPT)
quant_targets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quant_targets)


def _write_run(w: Path, batched_tg: float):
    def ours(name, **modes):
        results = [{"mode": m, "tok_s": t, "pct_of_bound": 80.0} for m, t in modes.items()]
        (w / f"oursq_{name}.json").write_text(json.dumps({"results": results}))

    def llama(name, decode, prefill=None):
        rows = [{"n_prompt": 0, "n_gen": 64, "avg_ts": decode}]
        rows += [{"n_prompt": 512, "n_gen": 0, "avg_ts": prefill}] if prefill else []
        (w / f"llamaq_{name}.json").write_text(json.dumps(rows))

    ours("qwen3_q4_k", decode=260.0)
    ours("qwen3_q4_k_2", decode=220.0)
    ours("mix_q4_0", decode=75.0, prefill=2100.0, batched_decode=250.0)
    ours("mix_q4_k", decode=50.0)
    ours("mix_q8_0", decode=40.0)
    ours("mix_dense", decode=24.0)
    llama("qwen3_Q4_K_M", 175.0)
    llama("mix_Q4_0", 37.5, prefill=500.0)
    llama("mix_Q4_K_M", 35.0)
    llama("mix_Q8_0", 25.0)
    (w / "llamaq_mix_Q4_0_batched.txt").write_text(
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
        f"|   128 |     32 |   16 |   2560 |    3.102 |   660.27 |    8.457 | {batched_tg:8.2f} |   11.559 |"
        "   221.48 |\n")


def test_every_target_is_judged_by_its_own_ratio(tmp_path):
    _write_run(tmp_path, batched_tg=60.5)
    measured, missing = quant_targets.cases(tmp_path)
    found = {c.name: c for c in measured}
    assert len(found) == 8 and missing == []
    assert found["Qwen3 q4_k decode"].ratio == pytest.approx(260 / 175) and found["Qwen3 q4_k decode"].met
    assert not found["Qwen3 q4_k decode (again)"].met  # 1.26x
    assert found["Mixtral q4_0 16 sequences"].reference == 60.5 and found["Mixtral q4_0 16 sequences"].met
    assert found["Mixtral q4_0 prefill 512"].ratio == pytest.approx(4.2)
    assert found["Mixtral q4_k decode"].target == 1.4 and found["Mixtral q4_k decode"].met  # 1.43x
    assert found["Mixtral q8_0 decode"].met  # 1.6x
    assert found["Mixtral q4_0 / our bf16 decode"].ratio == pytest.approx(75 / 24)
    assert "targets met: 7 of 8" in quant_targets.report(list(found.values()))


def test_a_faster_llama_batch_misses_the_16_sequence_target(tmp_path):
    _write_run(tmp_path, batched_tg=76.6)
    found = {c.name: c for c in quant_targets.cases(tmp_path)[0]}
    assert not found["Mixtral q4_0 16 sequences"].met  # 3.26x
    assert "targets met: 6 of 8" in quant_targets.report(list(found.values()))


def test_a_run_cut_short_reports_what_it_lacks(tmp_path):
    _write_run(tmp_path, batched_tg=60.5)
    (tmp_path / "oursq_mix_q8_0.json").unlink()
    measured, missing = quant_targets.cases(tmp_path)
    assert missing == ["Mixtral q8_0 decode"] and len(measured) == 7
    text = quant_targets.report(measured, missing)
    assert "Mixtral q8_0 decode" in text and "not measured" in text and "targets met: 6 of 8" in text


def test_the_script_writes_every_file_the_report_reads(tmp_path):
    """compare_quant_targets.sh names its outputs in shell; a renamed case there would leave a line unmeasured."""
    import re

    script = (SCRIPT.parent / "compare_quant_targets.sh").read_text()
    ours = set(re.findall(r"^\s+b (\S+) --shape", script, re.M))
    quantised = set(re.search(r"for q in ([^;]+); do", script).group(1).split())
    _write_run(tmp_path, batched_tg=60.5)
    for path in tmp_path.iterdir():
        name = path.name
        if name.startswith("oursq_"):
            assert name[len("oursq_"):-len(".json")] in ours, name
        elif name.startswith("llamaq_mix_") and name.endswith(".json"):
            assert name[len("llamaq_mix_"):-len(".json")] in quantised, name
        else:
            assert name in {"llamaq_qwen3_Q4_K_M.json", "llamaq_mix_Q4_0_batched.txt"} and name in script, name
    assert re.search(r'prompt=0; \[ "\$q" = Q4_0 \] && prompt=512', script)  # llama.cpp's prefill of 512
    assert re.search(r"b mix_q4_0 .*--prefill 512 --batch 16", script)  # ours, and its 16 sequences
