"""Verification: a draft proposes, one target forward verifies, the accepted path stays.

A round, for every sequence of the batch at once:

1. The drafter proposes a tree rooted at the sequence's last emitted token x (at position L, the first
   position not yet in the target's cache). A chain (greedy mode) is a tree whose nodes each have one
   child; beam mode drafts EAGLE-2 trees (top-k children per depth, the k best by cumulative draft
   log-probability expanded further, the `budget` best nodes of all kept).
2. One target forward runs the root and every node: node i at position L + depth(i), written into
   cache slot L + i, seeing the sequence's cache before L and its own ancestors (`tree_mask`). A chain
   needs no mask: its slots are its positions. Rows of different lengths share the forward; a row's
   mask hides what lies past its own end. The forward goes through the engine's expert executor, so
   an expert in RAM computes every token of every tree that routes to it in one call. Where the engine
   decodes through CUDA graphs, so does this forward (engine.generation.cuda_graphs, over the speculator's own
   cache, a shape once it recurs): a round that drafts nothing replays the plain decode step's graphs.
3. engine.speculative.rejection accepts a path: the longest run of drafts equal to the target's argmax
   at temperature 0 (so the output is plain greedy's, token for token), rejection sampling otherwise
   (the target's distribution kept exactly, Leviathan et al.; trees are drawn without replacement
   so the multi-candidate rule applies).
4. The accepted nodes' keys and values move to consecutive slots L+1.. on the device (`compact`); what
   the rejected nodes wrote stays past the row's end, never visible, overwritten by the next round.
   The drafter absorbs the target's features at the root and the accepted nodes (EAGLE's input).

`SpeculativeBatch` holds the rounds over rows that come and go; `Speculator.run` drives one for a list of
requests given at once, and `SpeculativeJob` is the engine's: the scheduler's decode thread steps it between
the plain batch's steps, admitting requests as they arrive (Engine.speculate, Engine.submit/stream with
SpeculativeOptions).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.decoder import synchronize
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.generation.sampling import sample_token, sample_tokens
from moedesk.engine.requests import Completion, Request, SamplingParams
from moedesk.engine.speculative import perf_model, rejection
from moedesk.engine.speculative.auto import (EXPLORE_HORIZON, AutoLedger, acceptance_estimate, auto_gamma,
                                             learn_acceptance)
from moedesk.engine.speculative.options import check_mode
from moedesk.engine.speculative.proposal import Proposal, node_depths, tree_mask
from moedesk.engine.speculative.rejection import processed_probs


@dataclass
class _Row:
    request: Request
    index: int  # row in the caches
    length: int = 0  # tokens in the target's cache (= the position of `last`)
    last: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    detokenizer: object = None
    drafted: int = 0
    accepted: int = 0
    tested: int = 0
    steps: int = 0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    started: float = 0.0  # when it was admitted (its prefill began)
    prefill_s: float = 0.0
    first_round: int = 0  # the batch's rounds before it came
    experts_before: object = None  # the executor's StepStats when it came
    streamed: list | None = None  # (token, text so far) of each token not yet streamed; None: nobody streams it

    @property
    def params(self) -> SamplingParams:
        return self.request.params


class Round(NamedTuple):
    """One round: its draft length, the rows it ran, milliseconds drafting, verifying and accepting, the
    tokens it emitted (accepted drafts plus each row's own token, less what a finishing row did not take), and
    the CUDA graph shapes its forward captured or ran eagerly before capturing (Speculator.graph_captures: a
    one-off cost a bench leaves out, as it does a plain run's first step)."""
    gamma: int
    rows: int
    draft_ms: float
    verify_ms: float
    accept_ms: float
    emitted: int
    captured: int = 0


@dataclass
class RunStats:
    """Every round of a run (`Round`)."""
    mode: str
    rounds: list = field(default_factory=list)  # of Round

    def summary(self) -> dict:
        if not self.rounds:
            return {}
        spec = [r for r in self.rounds if r.gamma > 0]
        ms = [r.draft_ms + r.verify_ms + r.accept_ms for r in self.rounds]
        return {"rounds": len(self.rounds), "speculative_rounds": len(spec),
                "step_ms": round(sum(ms) / len(ms), 3),
                "draft_ms": round(sum(r.draft_ms for r in self.rounds) / len(ms), 3),
                "verify_ms": round(sum(r.verify_ms for r in self.rounds) / len(ms), 3),
                "gammas": sorted({r.gamma for r in self.rounds}),
                # requests verified together per round: where speculation pays (MoESD), and what a job's
                # admissions between rounds achieved
                "mean_rows": round(sum(r.rows for r in self.rounds) / len(ms), 3)}


def check_request(request: Request, context_length: int) -> None:
    """Raise (one line) for a request speculative decoding cannot take."""
    if not request.prompt_ids:
        raise ValueError("speculative decoding needs a prompt of at least one token")
    if len(request.prompt_ids) >= context_length:
        raise MoedeskError(f"prompt has {len(request.prompt_ids)} tokens; the context is {context_length}")
    if request.grammar is not None:
        raise MoedeskError("speculative decoding does not take a response_format")
    if request.fed_tokens:
        raise MoedeskError("speculative decoding does not take fed tokens")


class Speculator:
    """Speculative decoding of a batch of requests over one model, through a runner of its own (`runner`:
    engine.generation.runner.ModelRunner, its cache, CUDA graphs, out-of-memory retry and stop set)."""

    def __init__(self, model, device, dtype, context_length: int, eos_token_ids=(), tokenizer=None, on_oom=None,
                 graphs=None, can_free=None):
        """graphs: replay target forwards from CUDA graphs over this speculator's cache (engine.generation.
        cuda_graphs): None where the device wants them (graphs_wanted), True/False, or a factory
        (model, cache) -> GraphedDecode (tests inject capture=False segments on the CPU). on_oom, can_free: as
        ModelRunner's."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.context_length = context_length
        self.tokenizer = tokenizer
        if graphs is None:
            from moedesk.engine.generation.cuda_graphs import graphs_wanted

            graphs = graphs_wanted(self.device)
        stops = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer is not None else frozenset())
        # The target's forwards over the speculator's own cache (its rows are the batch's), with their CUDA graphs.
        self.runner = ModelRunner(model, device, dtype, context_length, stops, on_oom=on_oom, graphs=graphs,
                                  advice="use a shorter draft or a smaller batch", can_free=can_free)

    @torch.no_grad()  # as the scheduler's decode thread runs: a drafter's forwards keep no autograd graphs
    def run(self, requests: list[Request], executor, drafter_factory, mode: str = "greedy", draft_length: int = 4,
            draft_width: int = 1, budget: int | None = None, costs: perf_model.StepCosts | None = None) -> tuple[list[Completion], RunStats]:
        """Complete `requests` together. drafter_factory(batch, capacity) makes the drafter for this batch.
        mode greedy: chains of draft_length; beam: trees of depth draft_length, draft_width children per node,
        `budget` nodes (default draft_length * draft_width); auto: chains whose length each round
        perf_model.choose_draft_length picks from `costs` (0: a plain step)."""
        check_mode(mode, draft_length, draft_width)
        if mode == "auto" and costs is None:
            raise ValueError("auto needs measured step costs")
        width = draft_width if mode == "beam" else 1
        for r in requests:
            self.check(r)
        started = time.perf_counter()
        longest_prompt = max(len(r.prompt_ids) for r in requests)
        capacity = longest_prompt + (draft_length + 1) * max(r.params.max_new_tokens for r in requests) \
            + (draft_length + 1) * max(width, 1) + 8
        batch = SpeculativeBatch(self, drafter_factory, mode, draft_length, width, budget, costs, capacity)
        rows = batch.admit(requests, executor)
        prefill_s = rows[0].prefill_s
        while batch.active():
            batch.round(executor)
        end = time.perf_counter()
        return [self._completion(r, started, prefill_s, end) for r in rows], batch.stats

    def check(self, request: Request) -> None:
        check_request(request, self.context_length)

    # --- steps --------------------------------------------------------------------------------

    def _reserve(self, rows: int, length: int) -> None:
        self.runner.reserve(rows, length)

    def _prefill(self, rows: list[_Row], executor, drafter) -> float:
        started = time.perf_counter()
        prompts = [r.request.prompt_ids for r in rows]
        longest = max(map(len, prompts))
        tokens = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(p)
        positions = torch.arange(longest).expand(len(rows), longest).clamp(max=self.context_length - 1)
        last = torch.tensor([len(p) - 1 for p in prompts])
        indices = [r.index for r in rows]
        # Rows 0..n-1 (a whole run, or a job's first newcomers) as a slice; rows elsewhere by index.
        where = None if indices == list(range(len(rows))) else torch.tensor(indices, device=self.device)
        out = self.runner.prefill(tokens.to(self.device), positions.to(self.device), executor, rows=where,
                                  logits_at=last.to(self.device), features=drafter.feature_keys)
        logits, hidden = out if drafter.feature_keys else (out, None)
        feats = drafter.combine(hidden) if hidden is not None else None
        cpu_logits = logits[:, -1].float().cpu()
        now = time.perf_counter()
        for i, r in enumerate(rows):
            p = prompts[i]
            r.length = len(p)
            token = sample_token(cpu_logits[i], r.params, r.generator)
            r.first_token_at = now
            self._take(r, [token])
            if r.finish_reason is None:
                drafter.absorb(r.index, 0, p[1:] + [token], None if feats is None else feats[i, :len(p)])
        return now - started

    def _verify(self, active, proposal: Proposal, executor, drafter):
        a, n = proposal.tokens.shape
        indices = [r.index for r in active]
        # Rows 0..A-1 as a slice, as the plain decoder passes them: a γ=0 round is then its very step.
        rows = None if indices == list(range(a)) else torch.tensor(indices, device=self.device)
        tokens = proposal.tokens.to(self.device)
        mask = slots = None
        if n == 1:  # the roots alone (γ = 0): the plain decode step's inputs, as Decoder.decode builds them
            positions = torch.tensor([[r.length] for r in active]).to(self.device)
        else:
            lengths = torch.tensor([r.length for r in active])
            depth = torch.tensor([node_depths(p) for p in proposal.parents])
            positions = (lengths[:, None] + depth).to(self.device)
            if not proposal.is_chain:
                kv_len = int(lengths.max()) + n
                keys = torch.arange(kv_len)
                tree = (keys[None, None, :] < lengths[:, None, None]).expand(a, n, kv_len).clone()
                for i, p in enumerate(proposal.parents):
                    tree[i, :, int(lengths[i]):int(lengths[i]) + n] = tree_mask(p)
                mask = tree[:, None].to(self.device)
                slots = (lengths[:, None] + torch.arange(n)).to(self.device)
        out = self.runner.step(tokens, positions, executor, rows, mask, slots, drafter.feature_keys)
        logits, hidden = out if drafter.feature_keys else (out, None)
        return logits, (drafter.combine(hidden) if hidden is not None else None)

    def graph_captures(self) -> int:
        """CUDA graph shapes captured so far over this speculator's cache, and forwards left eager until their
        shape recurs (GraphedDecode.warmups): each a new shape's one-off cost (0 without graphs)."""
        return self.runner.graph_captures()

    def _accept(self, active, proposal: Proposal, logits) -> tuple[list[list[int]], list[int]]:
        """Per active row: the accepted nodes (indices, root excluded, root-to-leaf) and the token after them."""
        paths: list[list[int]] = [[] for _ in active]
        nexts: list[int] = [0] * len(active)
        greedy = [i for i, r in enumerate(active) if r.params.temperature == 0]
        chain = proposal.is_chain
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            if chain:
                verdict = rejection.greedy_chain(proposal.tokens.to(logits.device)[g, 1:], logits[g])
                acc, nxt = verdict.accepted.tolist(), verdict.next_token.tolist()
                for j, i in enumerate(greedy):
                    paths[i], nexts[i] = list(range(1, acc[j] + 1)), nxt[j]
            else:
                for i in greedy:
                    parents = torch.tensor(proposal.parents[i])
                    v = rejection.greedy_tree(parents, proposal.tokens[i].to(logits.device), logits[i])
                    paths[i], nexts[i] = v.path[:int(v.accepted)].tolist(), int(v.next_token)
        undrafted = proposal.tokens.shape[1] == 1
        plain = [i for i, r in enumerate(active) if r.params.temperature > 0] if undrafted else []
        if plain:  # nothing drafted (γ = 0): the plain step's samples (Decoder._accept's sample_tokens)
            picked = sample_tokens(logits[plain, -1], [active[i].params for i in plain],
                                   [active[i].generator for i in plain])
            for i, token in zip(plain, picked):
                nexts[i] = token
        for i, r in enumerate(active):
            if r.params.temperature == 0 or undrafted:
                continue
            target = processed_probs(logits[i].float().cpu(), r.params)
            tokens = proposal.tokens[i].cpu()
            draft = (proposal.draft_probs[i] if proposal.draft_probs is not None
                     else torch.zeros(len(tokens), target.shape[-1]))  # a plain step: no draft
            if chain:
                v = rejection.sample_chain(tokens[1:], draft[:-1], target, r.generator)
                paths[i], nexts[i] = list(range(1, int(v.accepted) + 1)), int(v.next_token)
            else:
                v = rejection.sample_tree(torch.tensor(proposal.parents[i]), tokens, draft, target, r.generator)
                paths[i], nexts[i] = v.path[:int(v.accepted)].tolist(), int(v.next_token)
        return paths, nexts

    def _compact(self, active, paths, proposal: Proposal) -> None:
        """Move each row's accepted nodes from slots L + node to L + 1, L + 2, ... (one gather and one scatter
        per layer, on the device); chains are already in place."""
        self.runner.accept([r.index for r in active], [r.length for r in active], paths)

    def _emit(self, active, proposal, paths, nexts, feats, drafter, alpha_counts, gamma) -> int:
        """Take each row's accepted path and next token; the number of tokens the rows took."""
        tokens_cpu = proposal.tokens.cpu().tolist()
        taken = 0
        for i, r in enumerate(active):
            path = paths[i]
            emitted = [tokens_cpu[i][node] for node in path] + [nexts[i]]
            n_nodes = len(proposal.parents[i]) - 1
            r.drafted += n_nodes
            r.accepted += len(path)
            r.steps += 1
            depth = max(node_depths(proposal.parents[i]))
            tested = len(path) + (1 if len(path) < depth else 0)
            r.tested += tested
            alpha_counts[0] += len(path)
            alpha_counts[1] += tested
            start, before = r.length, len(r.tokens)
            self._take(r, emitted)
            taken += len(r.tokens) - before
            if r.finish_reason is None:
                f = None
                if feats is not None:
                    f = feats[i, [0] + path]
                drafter.absorb(r.index, start, emitted, f)
        return taken

    def _plain_tokens(self, active, logits) -> list[int]:
        """Each row's token in a round that drafted nothing, as the plain decode step takes it (Decoder._accept):
        sample_tokens over the batch, one argmax and one transfer for the greedy rows, the sampled ones drawn
        together on the device, each from its own generator. What _accept gives such a round, without a verdict."""
        return sample_tokens(logits[:, -1], [r.params for r in active], [r.generator for r in active])

    def _emit_plain(self, active, nexts, feats, drafter) -> int:
        """_emit for a round that drafted nothing: each row takes its token (a verify step, no drafts tested);
        the drafter absorbs it with the target's features at the root. The number of tokens the rows took."""
        taken = 0
        for i, r in enumerate(active):
            r.steps += 1
            start, before = r.length, len(r.tokens)
            self._take(r, [nexts[i]])
            taken += len(r.tokens) - before
            if r.finish_reason is None:
                drafter.absorb(r.index, start, [nexts[i]], None if feats is None else feats[i, :1])
        return taken

    def _take(self, r: _Row, emitted: list[int]) -> None:
        """Append tokens as plain decoding would, one by one, until the row finishes (EOS, stop string,
        max_new_tokens, the context's end). The first token of a row comes from the prefill."""
        for token in emitted:
            if r.tokens:
                r.length += 1
            if token in self.runner.stop_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            r.tokens.append(token)
            added = r.detokenizer.step(token) if r.detokenizer is not None else ""
            r.text += added
            stopped = False
            if r.params.stop and r.detokenizer is not None:
                cut = min((i for i in (r.text.find(s) for s in r.params.stop) if i >= 0), default=-1)
                if cut >= 0:
                    r.text = r.text[:cut]
                    stopped = True
            if r.streamed is not None:
                r.streamed.append((token, r.text))
            if stopped:
                r.finish_reason = "stop"
                break
            if len(r.tokens) >= r.params.max_new_tokens or r.length >= self.context_length:
                r.finish_reason = "length"
                break
        if r.finish_reason is None:
            r.last = r.tokens[-1]
        elif not r.finished_at:
            r.finished_at = time.perf_counter()

    def _completion(self, r: _Row, started: float, prefill_s: float, end: float) -> Completion:
        if self.tokenizer is not None and not (r.params.stop and r.finish_reason == "stop"):
            r.text = self.tokenizer.decode(r.tokens)
        done = r.finished_at or end
        decode_time = done - r.first_token_at
        stats = {
            "ttft_s": round(prefill_s, 4),
            "decode_tok_s": round((len(r.tokens) - 1) / decode_time, 2) if len(r.tokens) > 1 and decode_time > 0 else None,
            "total_s": round(done - started, 4),
            "speculative": {"drafted": r.drafted, "accepted": r.accepted, "verify_steps": r.steps,
                            "tokens_per_step": round((r.accepted + r.steps) / r.steps, 3) if r.steps else None,
                            "acceptance": round(r.accepted / r.tested, 3) if r.tested else None},
        }
        return Completion(tag=r.request.tag, token_ids=list(r.tokens), text=r.text, finish_reason=r.finish_reason,
                          prompt_tokens=len(r.request.prompt_ids), stats=stats)


class SpeculativeBatch:
    """Rounds of speculative decoding over rows that come and go, in one Speculator's cache: `admit` prefills
    newcomers into free rows (one forward), `round` drafts, verifies and accepts for every running row (one
    target forward), `release` frees a finished row for the next newcomer. Speculator.run is this with every
    request admitted at once; the scheduler's SpeculativeJob admits requests as they arrive.

    drafter_factory(batch, capacity) makes the drafter at the first admit; a drafter with `grow(batch)` (the
    EAGLE one) gets more rows when newcomers need them, one without keeps what it was made with."""

    def __init__(self, spec: Speculator, drafter_factory, mode: str, draft_length: int, width: int,
                 budget: int | None, costs, capacity: int, counts: tuple[float, float] = (0, 0)):
        self.spec, self.factory = spec, drafter_factory
        self.mode, self.draft_length, self.width = mode, draft_length, width
        self.budget = budget or draft_length * width
        self.nodes = max(self.budget, draft_length * width)
        self.costs, self.capacity = costs, capacity
        self.drafter = None
        self.rows: list[_Row | None] = []
        self.stats = RunStats(mode)
        self.alpha_counts = list(counts)  # accepted, tested: auto's running acceptance, from earlier requests on
        self.ledger = AutoLedger()

    def active(self) -> list[_Row]:
        return [r for r in self.rows if r is not None and r.finish_reason is None]

    def admit(self, requests: list[Request], executor, streamed: bool = False) -> list[_Row]:
        """Rows for `requests` (checked already: Speculator.check), prefilled together, each with its first
        token. streamed: record every token with its text in `_Row.streamed` for the caller to send on."""
        spec = self.spec
        started = time.perf_counter()
        free = [i for i, r in enumerate(self.rows) if r is None]
        new = []
        for request in requests:
            index = free.pop(0) if free else len(self.rows)
            if index == len(self.rows):
                self.rows.append(None)
            row = _Row(request, index,
                       generator=torch.Generator().manual_seed(request.params.seed)
                       if request.params.temperature > 0 else None,
                       detokenizer=spec.tokenizer.stream_decoder() if spec.tokenizer is not None else None,
                       started=started, first_round=len(self.stats.rounds), streamed=[] if streamed else None,
                       experts_before=executor.stats.copy() if hasattr(executor, "stats") else None)
            self.rows[index] = row
            new.append(row)
        longest = max(min(spec.context_length, len(r.prompt_ids) + r.params.max_new_tokens) for r in requests)
        spec._reserve(len(self.rows), longest + self.nodes + 1)
        if self.drafter is None:
            self.drafter = self.factory(len(self.rows), self.capacity)
        elif hasattr(self.drafter, "grow"):
            self.drafter.grow(len(self.rows))
        prefill_s = spec._prefill(new, executor, self.drafter)
        for row in new:
            row.prefill_s = prefill_s
        return new

    def round(self, executor) -> None:
        """One draft-verify-accept round over every running row."""
        spec, drafter = self.spec, self.drafter
        active = self.active()
        if not active:
            return
        room = min(spec.context_length - 1 - r.length for r in active)
        accepted, tested = self.alpha_counts
        if self.mode == "auto":
            horizon = min(EXPLORE_HORIZON, max(r.params.max_new_tokens for r in active))
            # the tokens the longest row may still take: what a probe's lesson could be used for (probe_value)
            remaining = min(room, max(r.params.max_new_tokens - len(r.tokens) for r in active))
            gamma = auto_gamma(self.costs, len(active), acceptance_estimate(accepted, tested), self.draft_length,
                               self.ledger, tested, horizon, remaining)
        else:
            gamma = self.draft_length
        gamma = max(0, min(gamma, room))
        t0 = time.perf_counter()
        proposal = drafter.propose([r.index for r in active], [r.length for r in active],
                                   [r.last for r in active], gamma, self.width, self.budget,
                                   [r.params for r in active], [r.generator for r in active],
                                   [len(r.tokens) for r in active])
        if gamma == 0 and proposal.tokens.shape[1] == 1:
            self._plain_round(active, proposal, executor, t0)
        else:
            self._verify_round(active, proposal, executor, gamma, t0)
        if self.mode == "auto":
            self.ledger = self.ledger.book(self.costs, len(active), gamma,
                                           1 + (self.alpha_counts[0] - accepted) / len(active), tested)
            self.alpha_counts = list(learn_acceptance((accepted, tested), self.alpha_counts[0] - accepted,
                                                      self.alpha_counts[1] - tested, 0 if gamma else 1))

    def _plain_round(self, active, proposal, executor, t0) -> None:
        """A round that drafts nothing (γ = 0: auto priced drafting out, or no room is left) at a plain decode step's
        host cost: the forward (the plain step's CUDA graphs where they are on), each row's token as the plain step
        takes it (Speculator._plain_tokens), no rejection and no compaction (nothing was drafted), the drafter
        absorbing the token with the target's features at the root. Recorded and priced (observe_round) as
        _verify_round records a round of γ = 0. No synchronize before the forward: a depth-0 proposal queued no
        device work (a drafter's state waits for its next drafting round), so there is none to leave out."""
        spec, drafter = self.spec, self.drafter
        captures = spec.graph_captures()
        t1 = time.perf_counter()
        logits, feats = spec._verify(active, proposal, executor, drafter)
        synchronize(spec.device)
        t2 = time.perf_counter()
        emitted = spec._emit_plain(active, spec._plain_tokens(active, logits), feats, drafter)
        t3 = time.perf_counter()
        captured = spec.graph_captures() - captures
        self._observe(len(active), 0, 1000 * (t3 - t1), captured)
        self.stats.rounds.append(Round(0, len(active), 1000 * (t1 - t0), 1000 * (t2 - t1), 1000 * (t3 - t2), emitted,
                                       captured))

    def _verify_round(self, active, proposal, executor, gamma, t0) -> None:
        """A round that verifies drafts: one target forward over every row's tree, a rejection verdict per row,
        the accepted nodes' keys and values compacted, the tokens taken."""
        spec, drafter = self.spec, self.drafter
        synchronize(spec.device)
        captures = spec.graph_captures()
        t1 = time.perf_counter()
        logits, feats = spec._verify(active, proposal, executor, drafter)
        synchronize(spec.device)
        t2 = time.perf_counter()
        if hasattr(self.costs, "observe_draft") and gamma:
            self.costs.observe_draft(1000 * (t1 - t0), gamma)
        paths, nexts = spec._accept(active, proposal, logits)
        spec._compact(active, paths, proposal)
        emitted = spec._emit(active, proposal, paths, nexts, feats, drafter, self.alpha_counts, gamma)
        t3 = time.perf_counter()
        captured = spec.graph_captures() - captures
        self._observe(len(active), gamma, 1000 * (t3 - t1), captured)
        self.stats.rounds.append(Round(gamma, len(active), 1000 * (t1 - t0), 1000 * (t2 - t1), 1000 * (t3 - t2),
                                       emitted, captured))

    def _observe(self, rows: int, gamma: int, ms: float, captured: int) -> None:
        """Auto prices rounds at what they cost (RunningCosts.observe_round), but not a round that captured CUDA
        graphs or ran eagerly before its shape's capture: that one-off cost is not what the next round of its shape
        will take."""
        if hasattr(self.costs, "observe_round") and not captured:
            self.costs.observe_round(rows, gamma, ms)

    def completion(self, row: _Row, executor=None) -> Completion:
        """A row's completion now, with the summary of the rounds it took part in (and its expert work)."""
        done = self.spec._completion(row, row.started, row.prefill_s, time.perf_counter())
        summary = RunStats(self.mode, self.stats.rounds[row.first_round:]).summary()
        done.stats["speculative"].update(mode=self.mode, **summary)
        if row.experts_before is not None and executor is not None:
            done.stats["experts"] = executor.stats.since(row.experts_before).as_dict()
        return done

    def release(self, row: _Row) -> None:
        """Free a finished (or cancelled) row's place for the next newcomer."""
        if row.index < len(self.rows) and self.rows[row.index] is row:
            self.rows[row.index] = None
            if hasattr(self.drafter, "release"):
                self.drafter.release(row.index)

