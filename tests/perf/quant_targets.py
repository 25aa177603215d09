"""Issue 15's targets from one run of tests/perf/compare_quant_targets.sh: `python3 tests/perf/quant_targets.py DIR`
reads that run's llama.cpp results (llamaq_*) and ours (oursq_*) from DIR, prints each case with its ratio, % of our
bound and target, and says how many targets were met."""
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Case:
    name: str
    ours: float
    reference: float  # llama.cpp's tok/s, or our bf16 decode for the 4-bit / 16-bit ratio
    target: float  # the ratio to reach
    pct_of_bound: float | None = None

    @property
    def ratio(self) -> float:
        return self.ours / self.reference

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


def _ours(w: Path, name: str) -> dict:
    return {r["mode"]: r for r in json.loads((w / f"oursq_{name}.json").read_text())["results"]}


def _llama(w: Path, name: str) -> dict:
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"]
            for r in json.loads((w / f"llamaq_{name}.json").read_text())}


def _batched16(path: Path) -> float:
    """llama-batched-bench's S_TG t/s on its 16-sequence row (prompt 128)."""
    rows = [line for line in path.read_text().splitlines() if re.match(r"\|\s+128", line)]
    return float(rows[-1].split("|")[8])


def cases(w: Path) -> tuple[list[Case], list[str]]:
    """(the cases measured, the names of those whose files or modes the run lacks: a phase cut short)."""
    w = Path(w)

    def decode(ours, llama, mode="decode"):
        return lambda: (_ours(w, ours)[mode], _llama(w, llama)[mode])

    def batched():
        return _ours(w, "mix_q4_0")["batched_decode"], _batched16(w / "llamaq_mix_Q4_0_batched.txt")

    def against_bf16():
        dense = _ours(w, "mix_dense")["decode"]
        return {**_ours(w, "mix_q4_0")["decode"], "pct_of_bound": dense["pct_of_bound"]}, dense["tok_s"]

    wanted = [("Qwen3 q4_k decode", 1.3, decode("qwen3_q4_k", "qwen3_Q4_K_M")),
              ("Qwen3 q4_k decode (again)", 1.3, decode("qwen3_q4_k_2", "qwen3_Q4_K_M")),
              ("Mixtral q4_0 decode", 1.5, decode("mix_q4_0", "mix_Q4_0")),
              ("Mixtral q4_0 prefill 512", 4.0, decode("mix_q4_0", "mix_Q4_0", "prefill")),
              ("Mixtral q4_0 16 sequences", 4.0, batched),
              ("Mixtral q4_k decode", 1.4, decode("mix_q4_k", "mix_Q4_K_M")),
              ("Mixtral q8_0 decode", 1.3, decode("mix_q8_0", "mix_Q8_0")),
              ("Mixtral q4_0 / our bf16 decode", 3.0, against_bf16)]
    found, missing = [], []
    for name, target, read in wanted:
        try:
            ours, reference = read()
        except (FileNotFoundError, KeyError, IndexError):
            missing.append(name)
            continue
        found.append(Case(name, ours["tok_s"], reference, target, ours["pct_of_bound"]))
    return found, missing


def report(found: list[Case], missing: list[str] = ()) -> str:
    lines = [f"{'case':<34}{'moedesk':>9}{'ref':>9}{'ratio':>7}{'target':>8}{'% bound':>9}  met"]
    for c in found:
        pct = f"{c.pct_of_bound:.0f}%" if c.pct_of_bound is not None else "-"
        lines.append(f"{c.name:<34}{c.ours:>9.1f}{c.reference:>9.1f}{c.ratio:>7.2f}{c.target:>7.1f}x{pct:>9}"
                     f"  {'yes' if c.met else 'NO'}")
    lines += [f"{name:<34}  not measured" for name in missing]
    met, total = sum(c.met for c in found), len(found) + len(missing)
    lines.append(f"targets met: {met} of {total} (ref: llama.cpp, or our bf16 decode for the 4-bit / 16-bit line, "
                 "whose % bound is the bf16 run's)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(*cases(Path(sys.argv[1]))))
