"""`moedesk bench --speculative`: what speculative decoding costs and yields on this machine and placement.

On a synthetic model of a real shape no trained draft head exists, so the draft is an oracle whose
acceptance α is chosen: the target's own greedy continuation from the plain run, each drafted token replaced
by a random other one with probability c. The target may reject an uncorrupted draft too: a k-token verify
forward rounds in bf16 unlike the one-token forwards that made the continuation, so at a near tie (a
random-weight model's logits are nearly flat) it may pick the other token, often enough that a fixed c = 1 - α
measured well under α (docs/measurements.md, "Speculation and the benches"). So the oracle tracks q, the fraction of its
uncorrupted drafts accepted so far, and corrupts with c = 1 - α / q: the measured acceptance is α (q stays 1
in float32, where c is 1 - α; where α > q it cannot be reached, c = 0, and the report says so). From such a
tie on, the precomputed continuation belongs to another sequence and every later draft of it would be wrong,
so the oracle redrafts that sequence before each verify step: the target decodes its next γ tokens greedily
from the actual prefix (plain forwards in a KV cache of the oracle's own, timed apart and left out). Drafting
costs nothing in the figures: what is measured is what verification costs and yields, against plain batched
decoding (CUDA graphs where the engine uses them) at the same batch size, on the same prompts.

Measured, for each batch size B: T(B, k), one forward of B sequences × k new tokens (k = 1..γ+1; from
CUDA graphs where the engine uses them, as `auto` measures it, engine.speculative.step_times.measure_step_times); plain decode; greedy chains of γ
drafts at each acceptance; `auto` at each acceptance (draft length chosen per round from the measured T
and the running acceptance, plain decoding where no draft could pay). The MoESD model
(engine.speculative.perf_model) is fitted to the T table; its predicted speedup at the measured acceptance
stands beside the measured one, with the fit's error recomputed from the fitted model at every measured point.

Each speculative run's tok/s is given twice: over the whole run, and over only the rounds that ran all B rows
(full batch). Every sequence has the same length, so plain decoding keeps every row busy to the end, while
speculative rows finish at different rounds, and the last rounds run a few rows at nearly a full round's cost
(with experts in RAM a round costs about the bytes of the experts it touches, which a few rows of γ + 1
tokens already mostly reach). The app's continuous batching refills finished rows, so the full-batch figure
is the steady state a user sees, and `auto` is judged on it (on the whole run where no round ran the full batch).

With `--model`/`--draft`/`--prompts` the same command measures a real model with its EAGLE head: acceptance
length per verify step over a prompt set, and end-to-end tok/s plain vs speculative (`run_draft_bench`).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from moedesk.bench.report_text import text_table
from moedesk.bench.synthetic import BenchModel, random_prompt
from moedesk.engine import json_read
from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.decoder import Decoder, synchronize
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative import perf_model
from moedesk.engine.speculative.auto import RunningCosts, auto_decodes_plainly
from moedesk.engine.speculative.proposal import Proposal, chain_parents
from moedesk.engine.speculative.step_times import measure_step_times
from moedesk.engine.speculative.verification import Speculator

PROMPT_TOKENS = 32
AUTO_FLOOR = 0.98  # issue 16: auto at least this fraction of plain decoding at every batch size
# Ridge points (tokens where a forward turns compute bound) the fit tries; the best-fitting one is kept. Where
# experts sit in RAM the ridge is the CPU's and the PCIe link's, not the GPU's, so it is not known beforehand.
RIDGES = (8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


# --- the oracle draft ---------------------------------------------------------------------------

AGREEMENT_PRIOR = 2  # the oracle's agreement starts as this many uncorrupted drafts tested, all accepted


class LookaheadOracle:
    """Drafts chains: the target's own greedy continuation of each sequence, each token replaced by a random other
    one with probability c. The continuation is `references[row]` (the plain run's tokens after the prompt)
    while the sequence still equals it; after it leaves it (or without references), the target decodes the
    draft from the sequence's actual prefix just before the verify step.

    The acceptance is what it controls. The target may reject an uncorrupted draft too (in bf16 a k-token verify
    forward rounds unlike the one-token forwards that made the continuation, and a near tie goes the other way),
    so the oracle tracks q, the fraction of its uncorrupted drafts that were accepted when tested, over the run
    so far (from a prior of AGREEMENT_PRIOR accepted), and corrupts with c = clamp(1 - acceptance / q, 0, 1):
    each tested draft is then accepted with probability (1 - c) q = acceptance. Where q stays 1 (float32) c is
    1 - acceptance; where acceptance > q it cannot be reached, c is 0, and the measured acceptance is q.

    For the redrafts it keeps its own KV cache of the sequences, brought up to date with the tokens emitted since
    (known from its own proposal and the counts the Speculator passes), so it needs nothing from the Speculator
    beyond the Drafter interface. `seconds`: its own forwards' time, for the caller to leave out; `redrafted`:
    rows that left their reference. Counts its chains' verdicts: `accepted` drafts of `tested` (a chain stops
    testing at its first rejection), and of its uncorrupted ones `clean_accepted` of `clean_tested`, the last
    round of each sequence added by `finish`."""

    feature_keys: tuple = ()

    def __init__(self, model, executor, prompts: list[list[int]], acceptance: float, capacity: int, dtype, device,
                 seed: int = 0, references: list[list[int]] | None = None):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.model, self.executor, self.device = model, executor, torch.device(device)
        self.prompts = [list(p) for p in prompts]
        self.acceptance = acceptance
        self.vocab = model.cfg.vocab_size
        self.capacity, self.dtype = capacity, dtype
        self.cache = None  # made when a row first needs redrafting
        self.generator = torch.Generator().manual_seed(seed)
        b = len(prompts)
        self.references = [list(r) for r in references] if references is not None else None
        self.on_reference = [references is not None] * b
        self.sequences: list[list[int]] = [[] for _ in range(b)]  # prompt + generated, as far as known
        self.synced = [0] * b  # positions of each row in its own cache
        self.emitted = [0] * b
        self.drafts: list[list[int]] = [[] for _ in range(b)]  # the row's last proposal, root excluded
        self.corrupted: list[list[bool]] = [[] for _ in range(b)]  # which of those drafts were corrupted
        self.accepted = [0] * b
        self.tested = [0] * b
        self.clean_accepted = self.clean_tested = 0  # over every row: uncorrupted drafts accepted, tested
        self.seconds = 0.0

    @property
    def agreement(self) -> float | None:
        """q as measured: the fraction of the uncorrupted drafts tested so far that the target accepted."""
        return self.clean_accepted / self.clean_tested if self.clean_tested else None

    @property
    def corruption(self) -> float:
        """c, the probability of corrupting the next draft: 1 - acceptance / q, q with its prior, in [0, 1]."""
        q = (self.clean_accepted + AGREEMENT_PRIOR) / (self.clean_tested + AGREEMENT_PRIOR)
        return 0.0 if q <= self.acceptance else 1.0 - self.acceptance / q

    @property
    def redrafted(self) -> int:
        return sum(not on for on in self.on_reference) if self.references is not None else len(self.on_reference)

    def absorb(self, row, start, tokens, features):
        pass  # the emitted tokens are known from the proposals

    def _catch_up(self, i: int, row: int, last: int, emitted: int, length: int) -> None:
        if not self.emitted[row]:
            self.sequences[row] = self.prompts[row] + [last]
        else:
            took = emitted - self.emitted[row] - 1  # accepted drafts of the last round; then the target's token
            self.sequences[row] += self.drafts[row][:took] + [last]
            self._score(row, took)
        self.emitted[row] = emitted
        if len(self.sequences[row]) != length + 1:
            raise MoedeskError("the lookahead oracle lost track of a sequence")
        if self.on_reference[row]:
            generated = self.sequences[row][len(self.prompts[row]):]
            self.on_reference[row] = self.references[row][:len(generated)] == generated

    def _score(self, row: int, took: int) -> tuple[int, int]:
        """Count the verdicts on the row's last proposal, of which `took` drafts were accepted: a chain tests its
        drafts up to the first rejection. (accepted, tested) of that proposal; it is then forgotten."""
        proposed, corrupted = self.drafts[row], self.corrupted[row]
        tested = took + (took < len(proposed)) if proposed else 0
        for j in range(tested):
            if not corrupted[j]:
                self.clean_tested += 1
                self.clean_accepted += j < took
        self.accepted[row] += took if proposed else 0
        self.tested[row] += tested
        self.drafts[row], self.corrupted[row] = [], []
        return (took if proposed else 0), tested

    def propose(self, rows, lengths, last, depth, width, budget, params, generators, emitted):
        if width > 1 or any(p.temperature > 0 for p in params):
            raise MoedeskError("the lookahead oracle drafts greedy chains only")
        for i, row in enumerate(rows):
            self._catch_up(i, row, last[i], emitted[i], lengths[i])
        if depth == 0:
            return Proposal([[-1]] * len(rows), torch.tensor(last).view(len(rows), 1), None)
        ahead = {}
        for row, e in zip(rows, emitted):
            reference = self.references[row][e:e + depth] if self.on_reference[row] else []
            if len(reference) == depth:
                ahead[row] = reference
        off = [row for row in rows if row not in ahead]
        if off:
            started = time.perf_counter()
            ahead.update(zip(off, self._lookahead(off, depth)))
            synchronize(self.device)
            self.seconds += time.perf_counter() - started
        tokens = []
        for i, row in enumerate(rows):
            drafts = [self._corrupt(t) for t in ahead[row]]
            self.drafts[row] = drafts
            self.corrupted[row] = [d != t for d, t in zip(drafts, ahead[row])]
            tokens.append([last[i]] + drafts)
        return Proposal([chain_parents(depth)] * len(rows), torch.tensor(tokens, dtype=torch.long), None)

    def _corrupt(self, token: int) -> int:
        if float(torch.rand((), generator=self.generator)) >= self.corruption:
            return token
        while True:
            other = int(torch.randint(self.vocab, (1,), generator=self.generator))
            if other != token:
                return other

    @torch.inference_mode()
    def _lookahead(self, rows: list[int], depth: int) -> list[list[int]]:
        """`depth` greedy tokens after each row's sequence: a forward of what the own cache lacks, then depth - 1
        one-token steps of all the rows together."""
        dev = self.device
        if self.cache is None:
            self.cache = self.model.new_cache(len(self.prompts), self.capacity, self.dtype, dev)
        first = {}
        # Rows new to the cache apart from the others: their whole sequence against a few tokens would pad the
        # others far past their ends.
        for group in ([r for r in rows if not self.synced[r]], [r for r in rows if self.synced[r]]):
            if group:
                first.update(zip(group, self._catch_up_forward(group)))
        token = torch.tensor([first[r] for r in rows], device=dev)
        out = [token]
        rows_t = torch.tensor(rows, device=dev)
        at = torch.tensor([len(self.sequences[r]) for r in rows], device=dev)
        for j in range(1, depth):
            logits = self.model(token.view(-1, 1), (at + j - 1).view(-1, 1), self.cache, self.executor, rows=rows_t)
            token = logits[:, -1].argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1).cpu().tolist()

    def _catch_up_forward(self, rows: list[int]) -> list[int]:
        """The tokens of `rows` not yet in the own cache in one forward (right-padded: padding writes past a row's
        end, where the next forward overwrites it); the greedy token after each row's last."""
        dev = self.device
        pending = [self.sequences[r][self.synced[r]:] for r in rows]
        n = max(map(len, pending))
        tokens = torch.zeros(len(rows), n, dtype=torch.long)
        for i, p in enumerate(pending):
            tokens[i, :len(p)] = torch.tensor(p)
        positions = torch.tensor([self.synced[r] for r in rows])[:, None] + torch.arange(n)
        last = torch.tensor([len(p) - 1 for p in pending])
        logits = self.model(tokens.to(dev), positions.to(dev), self.cache, self.executor,
                            rows=torch.tensor(rows, device=dev), logits_at=last.to(dev))
        for r in rows:
            self.synced[r] = len(self.sequences[r])
        return logits[:, -1].argmax(dim=-1).tolist()

    def finish(self, completions) -> tuple[int, int]:
        """(accepted, tested) over every round, the last of each sequence (after which no proposal came)
        included: its accepted count is the completion's total less what earlier rounds accepted. Scores
        those last rounds into the agreement too."""
        for row, c in enumerate(completions):
            self._score(row, c.stats["speculative"]["accepted"] - self.accepted[row])
        return sum(self.accepted), sum(self.tested)


class OracleCosts(RunningCosts):
    """Auto's costs with the oracle's drafting left at zero: its lookahead is the bench's, not a draft head's."""

    def observe_draft(self, ms: float, tokens: int) -> None:
        pass


# --- pure pieces ---------------------------------------------------------------------------------

def fit_step_table(table: dict[tuple[int, int], float], experts: int, top_k: int,
                   ridges=RIDGES) -> dict | None:
    """The MoESD target-time model fitted to T(B, k) (perf_model.fit_target_times), at the ridge point of
    `ridges` that fits best. The errors are recomputed here from the fitted model at every measured point
    (relative: predicted / measured - 1), so they are what the model does, not what the solver reported.
    None when there are fewer than 6 points."""
    points = [perf_model.StepTime(b, k, ms) for (b, k), ms in sorted(table.items())]
    if len(points) < 6:
        return None
    best = None
    for ridge in ridges:
        try:
            fitted = perf_model.fit_target_times(points, experts, top_k, ridge)
        except (ValueError, RuntimeError):
            continue
        residuals = fit_residuals(fitted.model, table)
        rms = float(np.sqrt(np.mean(np.square(list(residuals.values())))))
        if best is None or rms < best["rms_relative_error"]:
            best = {"model": fitted.model, "ridge_tokens": ridge, "rms_relative_error": rms,
                    "max_relative_error": float(max(abs(r) for r in residuals.values())), "residuals": residuals}
    return best


def fit_residuals(model: perf_model.SpeedupModel, table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    return {(b, k): float(perf_model.target_time(model, b * k)) / ms - 1.0 for (b, k), ms in table.items()}


def measured_acceptance(accepted: int, tested: int) -> float | None:
    return accepted / tested if tested else None


def full_batch_throughput(rounds, batch: int) -> tuple[float | None, int]:
    """(tok/s, rounds) of the rounds that ran all `batch` rows (`rows == batch`): the tokens they emitted over
    their verify and accept time. (None, 0) where none did. Rounds that captured CUDA graphs are left out, as
    plain_decode leaves out its first step."""
    full = [r for r in timed_rounds(rounds) if r.rows == batch]
    ms = sum(r.verify_ms + r.accept_ms for r in full)
    return (1000 * sum(r.emitted for r in full) / ms if ms > 0 else None), len(full)


def timed_rounds(rounds) -> list:
    """The rounds a speed figure counts: not those whose forward captured CUDA graphs (a one-off cost of each
    new shape, a share of a short run worth leaving out: docs/measurements.md, "Speculation and the benches")."""
    return [r for r in rounds if not r.captured]


# --- measurements ----------------------------------------------------------------------------------

def plain_decode(bench: BenchModel, prompts: list[list[int]], new_tokens: int, context: int):
    """Greedy tokens of every prompt decoded together as the engine does (CUDA graphs where it uses them), and
    tok/s from the second decode step to the last (the first captures the graphs), as `moedesk bench` times
    batched decode."""
    from moedesk.engine.generation.cuda_graphs import graphs_wanted

    device, b = bench.device, len(prompts)
    runner = ModelRunner(bench.model, device, bench.dtype, context, graphs=graphs_wanted(device))
    runner.reserve(b, context)
    decoder = Decoder(runner, bench.executor, None)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    tokens, start = {}, None
    for seq, _ in decoder.run([Request(p, params, tag=i) for i, p in enumerate(prompts)], batch_size=b):
        tokens[seq.request.tag] = seq.tokens
        if start is None and len(seq.tokens) == 2 and seq.row == b - 1:
            synchronize(device)
            start = time.perf_counter()
    synchronize(device)
    seconds = time.perf_counter() - start
    return [tokens[i] for i in range(b)], b * (new_tokens - 2) / seconds, 1000 * seconds / (new_tokens - 2)


def speculative_decode(bench: BenchModel, spec: Speculator, prompts, new_tokens: int, acceptance: float,
                       gamma: int, mode: str = "greedy", costs=None, seed: int = 0, references=None) -> dict:
    """One speculative run of `prompts` with the lookahead oracle at `acceptance`. tok/s counts the tokens the
    rounds emitted over their verify and accept time, rounds that captured CUDA graphs left out (timed_rounds):
    the oracle's own forwards are the bench's, not a draft's. full_batch_tok_s: the same over only the rounds
    that ran every sequence (`full_batch_throughput`)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [Request(p, params, tag=i) for i, p in enumerate(prompts)]
    capacity = max(map(len, prompts)) + new_tokens + 2 * gamma + 4
    oracle = LookaheadOracle(bench.model, bench.executor, prompts, acceptance, capacity, bench.dtype, bench.device,
                             seed, references)
    done, stats = spec.run(requests, bench.executor, lambda batch, cap: oracle, mode, gamma, 1, None, costs)
    rounds = stats.rounds
    timed = timed_rounds(rounds)
    seconds = sum(r.verify_ms + r.accept_ms for r in timed) / 1000
    tokens = sum(r.emitted for r in timed)
    accepted, tested = oracle.finish(done)
    steps = sum(c.stats["speculative"]["verify_steps"] for c in done)
    full_tok_s, full_rounds = full_batch_throughput(rounds, len(prompts))
    return {"tokens": [c.token_ids for c in done], "tok_s": tokens / seconds if seconds else 0.0,
            "full_batch_tok_s": full_tok_s, "full_batch_rounds": full_rounds,
            "capturing_rounds": len(rounds) - len(timed),
            "acceptance": measured_acceptance(accepted, tested), "agreement": oracle.agreement,
            "tokens_per_step": (accepted + steps) / steps if steps else None,
            "rounds": len(rounds), "speculative_rounds": sum(1 for r in rounds if r.gamma > 0),
            "gammas": sorted({r.gamma for r in rounds}),
            "verify_ms": sum(r.verify_ms for r in rounds) / len(rounds) if rounds else None,
            "accept_ms": sum(r.accept_ms for r in rounds) / len(rounds) if rounds else 0.0,
            "oracle_s": oracle.seconds, "redrafted": oracle.redrafted,
            # every round as it ran, so auto's decisions can be replayed on what each shape took
            "round_log": [[r.gamma, r.rows, round(r.verify_ms, 3), round(r.accept_ms, 3), r.emitted, r.captured]
                          for r in rounds]}


def measure_speculative(bench: BenchModel, batches=(1, 4, 16, 32), acceptances=(0.5, 0.7, 0.8, 0.9),
                        gamma: int = 4, new_tokens: int = 32, repeat: int = 3, log=print) -> dict:
    """Everything `moedesk bench --speculative` reports, on a prepared synthetic model (bench.synthetic)."""
    if gamma < 1:
        raise ValueError("the draft length must be at least 1")
    if new_tokens < 4:
        raise ValueError("need at least 4 new tokens per sequence")
    cfg, device = bench.cfg, bench.device
    batches = sorted(set(batches))
    started = time.perf_counter()
    raw = measure_step_times(bench.model, bench.executor, cfg, device, bench.dtype, batches, gamma + 1,
                             prompt=PROMPT_TOKENS, repeat=repeat)
    table = {tuple(int(x) for x in key.split(",")): ms for key, ms in raw.items()}
    log(f"T(B,k) for B {batches}, k 1..{gamma + 1} in {time.perf_counter() - started:.1f}s")
    fit = fit_step_table(table, cfg.num_experts, cfg.num_experts_per_tok)

    context = PROMPT_TOKENS + new_tokens + 2 * (gamma + 1) + 8
    spec = Speculator(bench.model, device, bench.dtype, context, cfg.eos_token_ids)
    per_batch, rows = [], []
    for b in batches:
        prompts = [random_prompt(PROMPT_TOKENS, cfg.vocab_size, 100 + i) for i in range(b)]
        # γ tokens past the runs' end: a draft near the end is then still the target's continuation.
        reference, first_plain_tok_s, plain_step_ms = plain_decode(bench, prompts, new_tokens + gamma, context)
        plain_tokens = [t[:new_tokens] for t in reference]
        # The first verify steps of a shape pay for allocations and kernel selection; a short run takes that.
        speculative_decode(bench, spec, prompts, min(new_tokens, 2 * gamma + 2), 1.0, gamma, references=reference)
        auto_ratios, auto_whole = [], []
        for alpha in acceptances:
            # Each acceptance's runs are judged against plain decoding timed just before them: the same steps drift
            # between the start of a batch size's runs and their end (docs/measurements.md, "Speculation and the
            # benches").
            _, plain_tok_s, _ = plain_decode(bench, prompts, new_tokens + gamma, context)
            run = speculative_decode(bench, spec, prompts, new_tokens, alpha, gamma, seed=7, references=reference)
            row = _row(b, alpha, "greedy", gamma, run, plain_tok_s, plain_tokens, fit, table)
            rows.append(row)
            log(_row_line(row))
            costs = OracleCosts(table)
            if auto_decodes_plainly(costs, b, gamma, new_tokens):
                # Engine.speculate runs the plain decode path itself here: the same code as the baseline.
                row = {"batch": b, "acceptance": alpha, "mode": "auto", "path": "plain", "gamma": 0,
                       "plain_tok_s": round(plain_tok_s, 2), "tok_s": round(plain_tok_s, 2), "speedup": 1.0,
                       "full_batch_tok_s": round(plain_tok_s, 2), "full_batch_rounds": None,
                       "full_batch_speedup": 1.0}
            else:
                run = speculative_decode(bench, spec, prompts, new_tokens, alpha, gamma, "auto", costs, seed=7,
                                         references=reference)
                row = _row(b, alpha, "auto", gamma, run, plain_tok_s, plain_tokens, None, None)
                row["path"] = "speculative"
            rows.append(row)
            auto_ratios.append(judged_speedup(row))
            auto_whole.append(row["speedup"])
            log(_row_line(row))
        eff = table[b, 1] / table[b, gamma + 1]
        per_batch.append({
            "batch": b, "plain_tok_s": round(first_plain_tok_s, 2), "plain_step_ms": round(plain_step_ms, 3),
            "T_ms": {str(k): round(table[b, k], 3) for k in range(1, gamma + 2)},
            "efficiency": round(eff, 4),
            "efficiency_fit": round(perf_model.target_efficiency(fit["model"], b, gamma), 4) if fit else None,
            "auto_min_speedup": round(min(auto_ratios), 4) if auto_ratios else None,
            "auto_min_speedup_whole_run": round(min(auto_whole), 4) if auto_whole else None,
            "auto_ok": all(r >= AUTO_FLOOR for r in auto_ratios)})
    report = {"gamma": gamma, "new_tokens": new_tokens, "prompt_tokens": PROMPT_TOKENS, "batches": batches,
              "acceptances": list(acceptances), "step_repeat": repeat,
              "step_times_ms": {f"{b},{k}": round(ms, 3) for (b, k), ms in sorted(table.items())},
              "fit": None, "per_batch": per_batch, "runs": rows,
              "auto_never_loses": all(p["auto_ok"] for p in per_batch), "auto_floor": AUTO_FLOOR,
              "auto_judged_on": "full_batch",
              "seconds": round(time.perf_counter() - started, 1)}
    if fit:
        m = fit["model"]
        report["fit"] = {"ridge_tokens": fit["ridge_tokens"], "rms_relative_error": round(fit["rms_relative_error"], 4),
                         "max_relative_error": round(fit["max_relative_error"], 4),
                         "residuals": {f"{b},{k}": round(r, 4) for (b, k), r in sorted(fit["residuals"].items())},
                         "params": {k: float(getattr(m, k)) for k in ("bias", "k1", "k2", "k3", "lam", "s")}}
    predicted = [r for r in rows if r.get("predicted_speedup")]
    if predicted:
        report["prediction_mean_abs_error"] = round(
            sum(abs(r["predicted_speedup"] / r["speedup"] - 1) for r in predicted) / len(predicted), 4)
    return report


def judged_speedup(row: dict) -> float:
    """The figure auto is judged on: the full-batch speedup, the whole run's where no round ran the full batch."""
    full = row.get("full_batch_speedup")
    return row["speedup"] if full is None else full


def _row(b, alpha, mode, gamma, run, plain_tok_s, plain_tokens, fit, table) -> dict:
    speedup = run["tok_s"] / plain_tok_s
    full = run["full_batch_tok_s"]
    q = run["agreement"]
    row = {"batch": b, "acceptance": alpha, "mode": mode, "gamma": gamma,
           "plain_tok_s": round(plain_tok_s, 2), "tok_s": round(run["tok_s"], 2), "speedup": round(speedup, 4),
           "full_batch_tok_s": None if full is None else round(full, 2),
           "full_batch_rounds": run["full_batch_rounds"], "capturing_rounds": run["capturing_rounds"],
           "full_batch_speedup": None if full is None else round(full / plain_tok_s, 4),
           "measured_acceptance": None if run["acceptance"] is None else round(run["acceptance"], 4),
           # the oracle's uncorrupted drafts the target accepted; below the requested acceptance it cannot be met
           "agreement": None if q is None else round(q, 4),
           "acceptance_capped": q is not None and q < alpha,
           "tokens_per_step": None if run["tokens_per_step"] is None else round(run["tokens_per_step"], 3),
           "verify_ms": None if run["verify_ms"] is None else round(run["verify_ms"], 3),
           "rounds": run["rounds"], "speculative_rounds": run["speculative_rounds"], "gammas": run["gammas"],
           # Temperature 0 decodes plain greedy's tokens up to rounding: in float32 exactly, in bf16 a k-token
           # forward may take the other side of a near tie, and the sequence goes its own way from there.
           "same_as_plain": round(sum(a == p for a, p in zip(run["tokens"], plain_tokens)) / len(plain_tokens), 3),
           "oracle_s": round(run["oracle_s"], 3), "redrafted_sequences": run["redrafted"],
           # [γ, rows, verify ms, accept ms, tokens emitted, graph shapes captured] of each round
           "round_log": run["round_log"]}
    if run["tokens_per_step"] is not None and mode == "greedy":
        # The model's acceptance: the α whose expected tokens per step match the measured ones. Its T_reject is
        # this run's own host time per round (accepting, moving accepted keys and values): the draft is free.
        a = perf_model.acceptance_from_tokens_per_step(run["tokens_per_step"], gamma)
        reject = run["accept_ms"]
        if fit is not None:
            costs = perf_model.ModelCosts(dataclasses.replace(fit["model"], reject_bias=reject))
            row["predicted_speedup"] = round(perf_model.predicted_speedup(costs, b, gamma, a), 4)
        if table is not None:
            p = perf_model.predicted_speedup(perf_model.MeasuredCosts(table, reject=reject), b, gamma, a)
            row["predicted_from_table"] = None if p is None else round(p, 4)
        row["accept_ms"] = round(reject, 3)
    return row


def _row_line(row: dict) -> str:
    acc, q, full = row.get("measured_acceptance"), row.get("agreement"), row.get("full_batch_speedup")
    return (f"B={row['batch']} α={row['acceptance']} {row['mode']}: {row['tok_s']:.1f} tok/s vs plain "
            f"{row['plain_tok_s']:.1f} ({row['speedup']:.2f}x"
            + (f"; full batch {full:.2f}x over {row['full_batch_rounds']} rounds"
               if full is not None and row.get("full_batch_rounds") else "") + ")"
            + (f", measured α {acc:.3f}" if acc is not None else "")
            + (f", uncorrupted drafts accepted {q:.3f}" if q is not None else "")
            + (f", path {row['path']}" if "path" in row else ""))


def format_speculative(report: dict) -> str:
    s = report["speculative"]
    g = s["gamma"]
    lines = [f"{report['shape']} x{report['layers']} layers, {report['experts']} experts, budget "
             f"{report['gpu_budget_gib']} GiB, {report['experts_on_gpu']} experts on GPU; γ = {g}, "
             f"{s['new_tokens']} new tokens per sequence after a {s['prompt_tokens']}-token prompt",
             "",
             "T(B,k): one forward of B sequences x k new tokens, ms (graphed where decode is, best of "
             f"{s['step_repeat']}); eff = T(B,1)/T(B,{g + 1}); plain = decode step as decoding runs it",
             f"{'B':>4}" + "".join(f"{'k=' + str(k):>9}" for k in range(1, g + 2)) + f"{'eff':>7}{'plain':>9}"]
    for p in s["per_batch"]:
        lines.append(f"{p['batch']:>4}" + "".join(f"{p['T_ms'][str(k)]:>9.1f}" for k in range(1, g + 2))
                     + f"{p['efficiency']:>7.2f}{p['plain_step_ms']:>9.1f}")
    fit = s["fit"]
    if fit:
        lines.append(f"MoESD fit (least squares over the {len(fit['residuals'])} T points, ridge "
                     f"{fit['ridge_tokens']:g} tokens): error rms {100 * fit['rms_relative_error']:.1f}%, "
                     f"max {100 * fit['max_relative_error']:.1f}%")
    else:
        lines.append("MoESD fit: fewer than 6 T points, not fitted")
    lines += ["",
              "speedup: tok/s of the whole run over plain decoding's; full-batch: of the rounds that ran all B rows",
              "(continuous batching keeps them full); α req, α meas: the oracle's acceptance requested and measured; "
              "agree: the",
              "fraction of its uncorrupted drafts the target accepted (below α req, α cannot be reached)"]
    capped, rows = False, []
    for r in s["runs"]:
        model = f"{r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") is not None else "-"
        full = f"{r['full_batch_speedup']:.2f}x" if r.get("full_batch_speedup") is not None else "-"
        acc = f"{r['measured_acceptance']:.2f}" if r.get("measured_acceptance") is not None else "-"
        if r.get("acceptance_capped"):
            acc, capped = acc + "*", True
        q = f"{r['agreement']:.2f}" if r.get("agreement") is not None else "-"
        tps = f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") is not None else "-"
        used = "plain path" if r.get("path") == "plain" else ",".join(map(str, r.get("gammas", [])))
        rows.append([str(r["batch"]), str(r["acceptance"]), r["mode"], f"{r['plain_tok_s']:.1f}", f"{r['tok_s']:.1f}",
                     f"{r['speedup']:.2f}x", full, model, acc, q, tps, used])
    # Each column as wide as its widest cell, two spaces apart: "plain path" no longer ran into the column before.
    lines += text_table(["B", "α req", "mode", "plain", "spec", "speedup", "full-batch", "model", "α meas", "agree",
                         "tok/step", "γ used"], rows, left=0)
    if capped:
        lines.append("* requested α above the agreement: the oracle corrupted nothing and cannot reach it")
    worst = min(s["per_batch"], key=lambda p: p["auto_min_speedup"] if p["auto_min_speedup"] is not None else 9)
    whole = [p["auto_min_speedup_whole_run"] for p in s["per_batch"] if p.get("auto_min_speedup_whole_run") is not None]
    judged = ("full-batch figure; the whole run's where no round ran the full batch"
              if s.get("auto_judged_on") == "full_batch" else "whole run")
    lines.append("")
    lines.append(f"auto >= {s['auto_floor']}x plain at every B ({judged}): {'yes' if s['auto_never_loses'] else 'NO'} "
                 f"(lowest {worst['auto_min_speedup']:.2f}x, at B={worst['batch']}"
                 + (f"; whole run lowest {min(whole):.2f}x" if whole and s.get("auto_judged_on") else "") + ")")
    if "prediction_mean_abs_error" in s:
        lines.append("model vs measured speedup (greedy rows): mean |error| "
                     f"{100 * s['prediction_mean_abs_error']:.1f}%")
    return "\n".join(lines)


# --- a real model with its draft head -------------------------------------------------------------

def load_prompts(path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of the prompts in a JSONL file (or a JSON list): each item a string (raw text), or an object
    with `prompt_ids`, `messages` (through the chat template), `turns` (MT-bench: its first turn as the user's
    message, through the chat template) or `prompt` (raw text, e.g. HumanEval)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoedeskError(f"--prompts {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        items = json_read.loads(text)
        items = items if isinstance(items, list) else [items]
    except ValueError:
        try:
            items = [json_read.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise MoedeskError(f"{path}: neither a JSON list nor JSONL ({str(e).splitlines()[0]})") from None
    out = []
    for n, item in enumerate(items[:limit] if limit else items, 1):
        if isinstance(item, dict) and "prompt_ids" in item:
            ids = [int(t) for t in item["prompt_ids"]]
        elif tokenizer is None:
            raise MoedeskError(f"{path}: item {n}: text prompts need a model with a tokenizer")
        elif isinstance(item, str):
            ids = tokenizer.encode(item)
        elif isinstance(item, dict) and "messages" in item:
            ids = tokenizer.chat_prompt(item["messages"])
        elif isinstance(item, dict) and item.get("turns"):
            ids = tokenizer.chat_prompt([{"role": "user", "content": item["turns"][0]}])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            ids = tokenizer.encode(item["prompt"])
        else:
            raise MoedeskError(f"{path}: item {n}: no prompt_ids, messages, turns or prompt")
        if not ids:
            raise MoedeskError(f"{path}: item {n}: empty prompt")
        out.append(ids)
    if not out:
        raise MoedeskError(f"{path}: no prompts")
    return out


def _groups(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def acceptance_length(engine, prompts: list[list[int]], draft, draft_length: int = 4, mode: str = "greedy",
                      draft_width: int = 4, budget: int | None = None, batch: int = 16,
                      max_new_tokens: int = 128) -> dict:
    """Mean tokens per verify step (accepted drafts plus the target's own token) of greedy (temperature 0)
    speculative decoding of `prompts` with `draft` (an EAGLE head folder or a drafter factory), `batch` prompts
    at a time. mode greedy: chains of draft_length; beam: trees of that depth, draft_width children per node,
    `budget` verified nodes (default draft_length: as many as the chain verifies)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    accepted = steps = drafted = 0
    for group in _groups(prompts, batch):
        done = engine.speculate([Request(p, params) for p in group], draft, mode, draft_length, draft_width,
                                budget or draft_length)
        for c in done:
            s = c.stats["speculative"]
            accepted, steps, drafted = accepted + s["accepted"], steps + s["verify_steps"], drafted + s["drafted"]
    return {"mode": mode, "draft_length": draft_length, "draft_width": draft_width if mode == "beam" else 1,
            "verified_nodes": budget or draft_length, "prompts": len(prompts), "verify_steps": steps,
            "accepted": accepted, "drafted": drafted,
            "tokens_per_step": round((accepted + steps) / steps, 4) if steps else None}


def run_draft_bench(engine, draft, prompts: list[list[int]], batches=(1, 4, 16), draft_length: int = 4,
                    draft_width: int = 4, max_new_tokens: int = 128, log=print) -> dict:
    """Acceptance length of the head over `prompts` (greedy chain; EAGLE-2 tree of the same verified nodes), and
    end-to-end tok/s (every token over the wall time, prefills included) of plain decoding (continuous batches
    of B) against greedy speculative decoding (groups of B) at each B."""
    if draft_length < 1:
        raise ValueError("the draft length must be at least 1")
    report = {"model": engine.name, "device": str(engine.device), "dtype": str(engine.dtype),
              "experts_on_gpu": engine.orchestra.summary().get("experts_on_gpu") if engine.orchestra else None,
              "prompts": len(prompts), "max_new_tokens": max_new_tokens, "draft_length": draft_length}
    # Warm-up: the decode graphs, the head's load, the step-time table auto would use.
    params = SamplingParams(max_new_tokens=4, temperature=0)
    list(engine.generate([Request(prompts[0], params)], batch_size=1))
    engine.speculate([Request(prompts[0], params)], draft, "greedy", draft_length)
    batch = max(batches)
    report["acceptance"] = [acceptance_length(engine, prompts, draft, draft_length, "greedy", batch=batch,
                                              max_new_tokens=max_new_tokens)]
    log(f"greedy chain γ={draft_length}: {report['acceptance'][0]['tokens_per_step']} tokens per verify step")
    if draft_width > 1:
        tree = acceptance_length(engine, prompts, draft, draft_length, "beam", draft_width, draft_length, batch,
                                 max_new_tokens)
        report["acceptance"].append(tree)
        log(f"tree depth {draft_length} width {draft_width}, {draft_length} nodes: {tree['tokens_per_step']} tokens "
            "per verify step")
    rows = []
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    for b in batches:
        started = time.perf_counter()
        plain = {c.tag: c.token_ids for c in engine.generate([Request(p, greedy, tag=i) for i, p in enumerate(prompts)],
                                                             batch_size=b)}
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        spec = []
        for group in _groups(prompts, b):
            spec += engine.speculate([Request(p, greedy) for p in group], draft, "greedy", draft_length)
        spec_s = time.perf_counter() - started
        plain_tokens = sum(len(t) for t in plain.values())
        spec_tokens = sum(len(c.token_ids) for c in spec)
        row = {"batch": b, "plain_tok_s": round(plain_tokens / plain_s, 2),
               "spec_tok_s": round(spec_tokens / spec_s, 2),
               "speedup": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 4),
               "same_as_plain": round(sum(plain[i] == c.token_ids for i, c in enumerate(spec)) / len(spec), 3)}
        rows.append(row)
        log(f"B={b}: plain {row['plain_tok_s']} tok/s, speculative {row['spec_tok_s']} tok/s ({row['speedup']:.2f}x)")
    report["throughput"] = rows
    return report


def format_draft(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']} ({report['dtype']}), {report['prompts']} prompts, up to "
             f"{report['max_new_tokens']} new tokens each, greedy",
             f"{'draft':<34}{'tokens/verify step':>20}{'verify steps':>14}"]
    for a in report["acceptance"]:
        name = (f"chain of {a['draft_length']}" if a["mode"] == "greedy" else
                f"tree depth {a['draft_length']} width {a['draft_width']}, {a['verified_nodes']} nodes")
        tps = f"{a['tokens_per_step']:.2f}" if a["tokens_per_step"] is not None else "-"
        lines.append(f"{name:<34}{tps:>20}{a['verify_steps']:>14}")
    lines += ["", f"{'B':>4}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'same':>7}"]
    for r in report["throughput"]:
        lines.append(f"{r['batch']:>4}{r['plain_tok_s']:>13.1f}{r['spec_tok_s']:>12.1f}{r['speedup']:>8.2f}x"
                     f"{r['same_as_plain']:>7.2f}")
    return "\n".join(lines)
