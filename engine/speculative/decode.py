"""Speculative decoding end to end: a draft proposes, one target forward verifies, the accepted path stays.

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

Drafters: `EagleDrafter` (an EAGLE-1/2/3 head, engine.speculative.eagle, with its own KV cache; rows of
the batch share its slots, holes masked) and `OracleDrafter` (proposes a known continuation, e.g. the
target's own greedy output, each token corrupted with a given probability: acceptance under control,
for tests and for benchmarks on synthetic shapes where no trained head exists).

`SpeculativeBatch` holds the rounds over rows that come and go; `Speculator.run` drives one for a list of
requests given at once, and `SpeculativeJob` is the engine's: the scheduler's decode thread steps it between
the plain batch's steps, admitting requests as they arrive (Engine.speculate, Engine.submit/stream with
SpeculativeOptions). In `auto` mode a pure decision (perf_model.choose_draft_length over measured step
times T(B, k) and the running acceptance) picks the draft length of every round, 0 meaning a plain step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.decoder import retrying_oom, synchronize
from moedesk.engine.generation.kv_cache import KVCache
from moedesk.engine.requests import Completion, Request, SamplingParams
from moedesk.engine.generation.sampling import sample_token, sample_tokens, sampling_probs
from moedesk.engine.speculative import perf_model, rejection

MODES = ("off", "greedy", "beam", "auto")


# --- pure pieces --------------------------------------------------------------------------------

def node_depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i sees node j when j is i or one of its ancestors (parents precede children)."""
    n = len(parents)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] = seen[p]
        seen[i, i] = True
    return seen


def chain_parents(gamma: int) -> list[int]:
    return [-1] + list(range(gamma))


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution engine.generation.sampling.sample_tokens draws from (temperature, top-k, top-p), over the
    last dimension of float logits: rejection sampling needs both models' distributions as actually sampled."""
    rows = logits.reshape(-1, logits.shape[-1])
    return sampling_probs(rows, [params] * rows.shape[0]).reshape(logits.shape)


def acceptance_estimate(accepted: int, tested: int, prior_accepted: float = 1.0, prior_tested: float = 2.0) -> float:
    """Per-draft acceptance α from counts: `tested` drafts reached (a chain stops testing at its first
    rejection), `accepted` of them taken; a weak prior (one of two) so that early steps do not swing it."""
    return (accepted + prior_accepted) / (tested + prior_tested)


# Speculate at all, in auto mode, only if even this acceptance would make it pay (else plain decoding
# through the engine's own decode path, CUDA graphs included).
OPTIMISTIC_ALPHA = 0.9
# Auto's exploration (auto_gamma): rounds may lose at most this share of plain decoding's time...
EXPLORE_SHARE = 0.01
# ...counted as at least this many plain steps (or the run's length, if shorter), so that a run can probe in
# its first rounds.
EXPLORE_HORIZON = 160
# Probe while this many more accepted drafts would make drafting pay: the evidence behind the estimate.
OPTIMISM = 4


@dataclass(frozen=True)
class AutoLedger:
    """Auto's rounds priced by the step costs against plain decoding of the tokens they took: its exploration
    budget. Per batch, as the acceptance counts are."""
    plain_ms: float = 0.0  # plain decoding's time for those tokens: T(B, 1) per token of each row
    loss_ms: float = 0.0  # the rounds' time less plain_ms; negative where drafting gained

    def book(self, costs: perf_model.StepCosts, batch: int, gamma: int, tokens_per_row: float) -> AutoLedger:
        """After a round of `gamma` drafts in which each of the `batch` rows took `tokens_per_row` on average."""
        ar, step = costs.ar_ms(batch), perf_model.step_ms(costs, batch, gamma)
        if ar is None or step is None:
            return self
        plain = tokens_per_row * ar
        return AutoLedger(self.plain_ms + plain, self.loss_ms + step - plain)

    def room_ms(self, ar_ms: float, horizon: int = EXPLORE_HORIZON) -> float:
        """What a round may still lose: EXPLORE_SHARE of plain decoding's time so far (at least `horizon` steps
        of it), less what earlier rounds lost."""
        return EXPLORE_SHARE * max(self.plain_ms, horizon * ar_ms) - self.loss_ms


def auto_gamma(costs: perf_model.StepCosts, batch: int, alpha: float, max_gamma: int,
               ledger: AutoLedger = AutoLedger(), evidence: int = 0, horizon: int = EXPLORE_HORIZON) -> int:
    """The draft length of the next round in auto mode, 0 for a plain step.

    alpha is acceptance_estimate's, over `evidence` tested drafts. Exploit: the γ that choose_draft_length
    finds pays at alpha. Else probe: the γ that would pay if the next OPTIMISM drafts tested were all
    accepted, (accepted + 1 + 4) / (tested + 2 + 4): 5/6 before any evidence, 5/9 after three rejections,
    under the 0.56 a Qwen3 batch-1 table needs, so probing ends on its own for a bad draft. One good probe
    of 4 drafts (or one accepted 1-draft probe) lifts the estimate itself past that.

    Either way a round goes ahead only if, with nothing accepted, it leaves the ledger within its budget: a
    round of γ drafts loses at most γ·T_draft + T(B, γ+1) + T_reject - T(B, 1) (one token for the price of a
    verify step); if that γ does not fit, the longest shorter one that fits (and, to exploit, still pays at
    alpha) is taken. So by construction, in the costs' own model and at a fixed B, auto's time for n tokens
    per row is at most plain decoding's plus EXPLORE_SHARE · max(n, horizon) · T(B, 1), whatever the
    acceptance. The batch passes horizon = min(EXPLORE_HORIZON, its longest request): 1.01x plain for a run
    of any length that goes to its end (a short run has little to gain and probes little), 1.017x at worst
    for one cut short at 96 of 160 tokens.

    What the budget buys on the Qwen3 batch-1 shape (T(1,2) = 1.6 and T(1,5) = 1.96 times T(1,1), drafting
    free), for a run of 160 tokens or more: 1.6 plain steps at the start, i.e. a 4-draft probe in the first
    round (loses 0.96 steps if its first draft is rejected) and a 1-draft one after it (0.6), then one 4-draft
    probe per 96 plain steps; a probe that accepts j of 4 drafts books (0.96 - j) steps, so a good draft pays
    for its next probes at once. Simulated there at acceptance 0.8 (the tests): the estimate alone drafts
    within 24 rounds in 93 runs of 100 of 160 tokens (auto 1.65x plain on average against chains' 1.71x), in
    81 of 100 of 96 tokens (1.55x). The old rule (a 1-draft probe after 64 plain steps in a row) never
    speculated in a 96-token run on the GPU box (1.02x)."""
    ar = costs.ar_ms(batch)
    if ar is None:
        return 0
    gamma = perf_model.choose_draft_length(costs, batch, alpha, max_gamma).gamma
    probe = not gamma
    if probe:
        n = evidence + 2  # acceptance_estimate's prior counts too
        gamma = perf_model.choose_draft_length(costs, batch, (alpha * n + OPTIMISM) / (n + OPTIMISM), max_gamma).gamma
    room = ledger.room_ms(ar, horizon)
    for g in range(gamma, 0, -1):
        step = perf_model.step_ms(costs, batch, g)
        if step is not None and step - ar <= room and (
                probe or perf_model.predicted_speedup(costs, batch, g, alpha) >= 1.0 + perf_model.SAFETY_MARGIN):
            return g
    return 0


def auto_decodes_plainly(costs: perf_model.StepCosts, batch: int, max_gamma: int,
                         horizon: int = EXPLORE_HORIZON) -> bool:
    """Whether auto hands `batch` new requests, the longest asking `horizon` new tokens, to plain decoding (its CUDA
    graphs and all) instead of running rounds: where not even an optimistic acceptance (OPTIMISTIC_ALPHA) makes any
    draft length pay at this batch size, or where its first round, with no evidence yet, could not afford a probe
    (auto_gamma with min(horizon, EXPLORE_HORIZON)). The budget of a run no longer than that horizon does not grow
    with its plain rounds, so such a run would draft nothing to its end, paying for the speculative path's rounds
    instead of plain steps (on the GPU box: Qwen3 shape, B = 1, 32 tokens: 0.90-1.00x plain in one run)."""
    if not perf_model.choose_draft_length(costs, batch, OPTIMISTIC_ALPHA, max_gamma).gamma:
        return True
    prior = acceptance_estimate(0, 0)
    return not auto_gamma(costs, batch, prior, max_gamma, AutoLedger(), 0, min(horizon, EXPLORE_HORIZON))


# How likely a sampled tree's k-th drawn child is to be accepted, for shaping the tree without looking at
# what was drawn (roughly what EAGLE-2 trees accept by rank); strictly decreasing, so siblings keep their
# draw order and a child never outranks its parent.
RANK_PRIOR = [0.6, 0.2, 0.08, 0.04, 0.02, 0.01, 0.005, 0.0025]


# --- proposals and drafters ---------------------------------------------------------------------

@dataclass
class Proposal:
    """Trees for the active rows, each of N+1 nodes (node 0: the root, the row's last emitted token)."""
    parents: list[list[int]]
    tokens: torch.Tensor  # [A, N+1] long, on the target's device
    draft_probs: torch.Tensor | None = None  # [A, N+1, V] on the CPU: a node's children were drawn from its row

    @property
    def is_chain(self) -> bool:
        return all(p == chain_parents(len(p) - 1) for p in self.parents)


class Drafter(Protocol):
    feature_keys: tuple  # what the target forward returns for it (engine.model.transformer.Transformer.forward)

    def absorb(self, row: int, start: int, tokens: list[int], features: torch.Tensor | None) -> None:
        """Target features at positions start.. with the tokens that follow each (EAGLE's row pairing)."""

    def propose(self, rows: list[int], lengths: list[int], last: list[int], depth: int, width: int, budget: int,
                params: list[SamplingParams], generators: list, emitted: list[int]) -> Proposal: ...


class OracleDrafter:
    """Proposes `references[row]` (e.g. the target's own greedy continuation), each proposed token replaced by
    a random other one with probability `corruption`: per-draft acceptance 1 - corruption at temperature 0.
    Trees: a spine along the reference, each spine node with width-1 random siblings. Its draft is a
    point mass, so rejection sampling is exact for chains; sampled trees are refused."""

    feature_keys: tuple = ()

    def __init__(self, references: list[list[int]], corruption: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= corruption <= 1.0:
            raise ValueError(f"corruption must be in [0, 1], got {corruption}")
        self.references, self.corruption, self.vocab = references, corruption, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def absorb(self, row, start, tokens, features):
        pass

    def _random_other(self, avoid: set[int]) -> int:
        while True:
            t = int(torch.randint(self.vocab, (1,), generator=self.generator))
            if t not in avoid:
                return t

    def _spine(self, row: int, emitted: int, depth: int) -> list[int]:
        ref = self.references[row] if row < len(self.references) else []
        out = []
        for j in range(depth):
            i = emitted + j
            want = ref[i] if i < len(ref) else None
            bad = want is None or float(torch.rand((), generator=self.generator)) < self.corruption
            out.append(self._random_other({want}) if bad else want)
        return out

    def propose(self, rows, lengths, last, depth, width, budget, params, generators, emitted):
        sampled = any(p.temperature > 0 for p in params)
        if sampled and width > 1:
            raise MoedeskError("the oracle draft proposes trees only at temperature 0")
        parents_all, tokens_all = [], []
        for i, row in enumerate(rows):
            spine = self._spine(row, emitted[i], depth)
            parents, tokens = [-1], [last[i]]
            at = 0
            for t in spine:
                node = len(parents)
                parents.append(at)
                tokens.append(t)
                for _ in range(width - 1):
                    parents.append(at)
                    tokens.append(self._random_other(set(tokens[-(width - 1) - 1:]) | {t}))
                at = node
            parents_all.append(parents[:budget + 1])  # creation order: a prefix keeps every node's parent
            tokens_all.append(tokens[:budget + 1])
        tokens = torch.tensor(tokens_all, dtype=torch.long)
        probs = None
        if sampled:  # a chain: node j's child was "drawn" from a point mass on it
            probs = F.one_hot(torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1), self.vocab).float()
        return Proposal(parents_all, tokens, probs)


class EagleDrafter:
    """An EAGLE head drafting for a batch of `batch` rows. Its cache slots are shared by the rows: a forward
    appends T slots for every row; a row's unused ones (it had fewer rows to absorb) are holes its masks
    hide, and draft rows are dropped at the next absorb (the cache is cut back to `committed`)."""

    def __init__(self, head, target_layers: int, batch: int, capacity: int):
        from moedesk.engine.speculative.eagle import eagle3_feature_layers

        self.head = head
        self.version = head.cfg.version
        self.feature_keys = ("final",) if self.version != 3 else tuple(eagle3_feature_layers(target_layers))
        self.device = head.fc.weight.device
        self.cache = head.new_cache(batch, capacity)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.committed = 0
        self.batch = batch
        self.pending: list[list] = [[] for _ in range(batch)]  # (start, tokens, features) not yet run
        self.root = torch.zeros(batch, head.cfg.hidden_size, dtype=head.fc.weight.dtype, device=self.device)
        # Slots a round's drafting may append after the absorbed ones: compacting early enough to leave them
        # matters only where rows come and go (a SpeculativeJob); a run's capacity already holds everything.
        self.draft_room = 0

    def grow(self, batch: int, capacity: int = 0) -> None:
        """Room for `batch` rows and `capacity` slots (a scheduler's job admitting more requests, or longer ones,
        than it started with); what is stored stays."""
        capacity = max(capacity, self.cache.capacity)
        if batch <= self.batch and capacity == self.cache.capacity:
            return
        batch = max(batch, self.batch)
        cache = self.head.new_cache(batch, capacity)
        used = self.cache.length
        cache.keys[:self.batch, :, :used] = self.cache.keys[:, :, :used]
        cache.values[:self.batch, :, :used] = self.cache.values[:, :, :used]
        cache.length = used
        self.cache = cache
        valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        valid[:self.batch, :self.valid.shape[1]] = self.valid
        self.valid = valid
        self.root = torch.cat([self.root, torch.zeros(batch - self.batch, self.root.shape[1], dtype=self.root.dtype,
                                                      device=self.device)])
        self.pending += [[] for _ in range(batch - self.batch)]
        self.batch = batch

    def release(self, row: int) -> None:
        """The row's request ended: its slots stop counting (compaction keeps only live rows' slots) and a
        newcomer in it starts from nothing."""
        self.valid[row] = False
        self.pending[row] = []

    def combine(self, hidden: dict) -> torch.Tensor:
        """The head's input feature from the target's hidden states ([A, T, F])."""
        return torch.cat([hidden[k] for k in self.feature_keys], dim=-1)

    def absorb(self, row, start, tokens, features):
        self.pending[row].append((start, list(tokens), features))

    # -- the head's forwards --

    def _forward(self, tokens, features, positions, own_mask, from_target):
        """tokens/positions [B, T], features [B, T, F], own_mask [B, T, S + T] over the slots after the committed
        ones (this round's S draft rows so far, then these T; the committed valid slots are added)."""
        b, t = tokens.shape
        if self.cache.length + t > self.cache.capacity:
            raise MoedeskError("the draft head's cache is full")
        prefix = self.valid[:, :self.committed].unsqueeze(1).expand(b, t, self.committed)
        mask = torch.cat([prefix, own_mask], dim=-1)
        return self.head(tokens, features, positions, self.cache, mask=mask, from_target=from_target)

    def _absorb_pending(self) -> None:
        self.cache.truncate(self.committed)
        counts = [sum(len(tk) for _, tk, _ in self.pending[r]) for r in range(self.batch)]
        t = max(counts)
        if t == 0:
            return
        if self.committed + t + self.draft_room > self.cache.capacity:
            self._compact()
            if self.committed + t + self.draft_room > self.cache.capacity:  # only where rows come and go
                self.grow(self.batch, (self.committed + t + self.draft_room) * 3 // 2)
        feature_width = next(f.shape[-1] for rows in self.pending for _, _, f in rows)
        dtype = self.head.fc.weight.dtype
        tokens = torch.zeros(self.batch, t, dtype=torch.long)
        positions = torch.zeros(self.batch, t, dtype=torch.long)
        features = torch.zeros(self.batch, t, feature_width, dtype=dtype, device=self.device)
        for r, rows in enumerate(self.pending):
            at = 0
            for start, tk, f in rows:
                n = len(tk)
                tokens[r, at:at + n] = torch.tensor(tk)
                positions[r, at:at + n] = torch.arange(start, start + n)
                features[r, at:at + n] = f.to(dtype)
                at += n
        count = torch.tensor(counts, device=self.device)
        real = torch.arange(t, device=self.device)[None, :] < count[:, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        own = (causal[None] & real[:, None, :]) | torch.eye(t, dtype=torch.bool, device=self.device)[None]
        start = self.cache.length
        hidden = self._forward(tokens.to(self.device), features, positions.to(self.device), own, True)
        self.valid[:, start:start + t] = real
        self.committed = self.cache.length
        have = count > 0
        last = hidden[torch.arange(self.batch, device=self.device), (count - 1).clamp_min(0)]
        self.root = torch.where(have[:, None], last, self.root)
        self.pending = [[] for _ in range(self.batch)]

    def _compact(self) -> None:
        """Every row's valid slots to the front (rarely: when the shared slots run out)."""
        counts = self.valid[:, :self.committed].sum(dim=1)
        n = int(counts.max())
        order = torch.argsort((~self.valid[:, :self.committed]).to(torch.int8), dim=1, stable=True)[:, :n]
        self.cache.keep(order, 0)
        self.valid.zero_()
        self.valid[:, :n] = torch.arange(n, device=self.device)[None] < counts[:, None]
        self.committed = n

    def _draft_dist(self, hidden, sampled_rows):
        """Log-probabilities for choosing children ([..., V] over the target vocabulary): the head's softmax
        for greedy rows, its processed (temperature/top-k/top-p) distribution for sampled ones."""
        logits = self.head.target_vocab_logits(hidden).float()
        logp = torch.log_softmax(logits, dim=-1)
        for i, p in sampled_rows:
            logp[i] = processed_probs(logits[i], p).log()
        return logp

    def propose(self, rows, lengths, last, depth, width, budget, params, generators, emitted):
        a = len(rows)
        if depth == 0:  # a plain step: what it emits is absorbed with the next draft's first forward
            return Proposal([[-1]] * a, torch.tensor(last).view(a, 1), None)
        self._absorb_pending()
        rows_t = torch.tensor(rows, device=self.device)
        sampled = [(i, p) for i, p in enumerate(params) if p.temperature > 0]
        root_logp = self._draft_dist(self.root[rows_t], sampled)  # [A, V]
        if width <= 1:
            return self._chain(rows_t, lengths, last, depth, root_logp, params, sampled, generators)
        return self._tree(rows_t, lengths, last, depth, width, budget, root_logp, params, sampled, generators)

    def _pick(self, logp, k, sampled, generators):
        """k children per row of logp [A, M, V]: the top k for greedy rows, drawn without replacement (in draw
        order) for sampled ones; (tokens [A, M, k], log-probs [A, M, k])."""
        values, ids = torch.topk(logp, k, dim=-1)
        for i, _ in sampled:
            probs = logp[i].exp().cpu()
            if int((probs > 0).sum(dim=-1).min()) < k:
                raise MoedeskError(f"a draft width of {k} needs at least {k} tokens the sampling allows "
                                   "(raise top_k / top_p or narrow the draft)")
            drawn = torch.stack([torch.multinomial(row, k, replacement=False, generator=generators[i]) for row in probs])
            ids[i] = drawn.to(ids.device)
            values[i] = logp[i].gather(-1, ids[i])
        return ids, values

    def _row_forward(self, rows_t, tokens, features, positions, own_mask):
        """A head forward of [A, T] rows for the active rows only; the others get dummies that see themselves."""
        b, t, w = self.batch, tokens.shape[1], own_mask.shape[-1]
        full_tokens = torch.zeros(b, t, dtype=torch.long, device=self.device)
        full_features = torch.zeros(b, t, features.shape[-1], dtype=features.dtype, device=self.device)
        full_positions = torch.zeros(b, t, dtype=torch.long, device=self.device)
        full_mask = torch.zeros(b, t, w, dtype=torch.bool, device=self.device)
        full_mask[:, torch.arange(t), w - t + torch.arange(t)] = True
        full_tokens[rows_t], full_features[rows_t], full_positions[rows_t], full_mask[rows_t] = \
            tokens, features, positions, own_mask
        hidden = self._forward(full_tokens, full_features, full_positions, full_mask, False)
        return hidden[rows_t]

    def _chain(self, rows_t, lengths, last, depth, root_logp, params, sampled, generators):
        a = len(lengths)
        tokens = [torch.tensor(last, device=self.device)]
        probs = [root_logp.exp()] if sampled else None
        ids, _ = self._pick(root_logp.unsqueeze(1), 1, sampled, generators)
        tokens.append(ids[:, 0, 0])
        hidden = self.root[rows_t]
        base = torch.tensor(lengths, device=self.device)
        chain_mask = torch.ones(a, 1, 0, dtype=torch.bool, device=self.device)
        for j in range(1, depth):
            chain_mask = torch.cat([chain_mask, torch.ones(a, 1, 1, dtype=torch.bool, device=self.device)], dim=-1)
            hidden = self._row_forward(rows_t, tokens[-1].view(a, 1), hidden.view(a, 1, -1),
                                       (base + j - 1).view(a, 1), chain_mask)[:, 0]
            logp = self._draft_dist(hidden, sampled)
            if probs is not None:
                probs.append(logp.exp())
            ids, _ = self._pick(logp.unsqueeze(1), 1, sampled, generators)
            tokens.append(ids[:, 0, 0])
        draft_probs = None
        if probs is not None:
            probs.append(torch.zeros_like(probs[0]))  # the last node has no children
            draft_probs = torch.stack(probs, dim=1).cpu()
        return Proposal([chain_parents(depth)] * a, torch.stack(tokens, dim=1), draft_probs)

    def _tree(self, rows_t, lengths, last, depth, width, budget, root_logp, params, sampled, generators):
        """EAGLE-2: the root's `width` best children; at each further depth the `width` best nodes of the
        last depth (by cumulative log-probability) each get `width` children; the `budget` best nodes of all
        are verified. Sampled rows draw children without replacement and score them by a fixed prior per
        rank (`RANK_PRIOR`) instead of their draft probabilities: rejection sampling of a tree stays exact only
        if whether a candidate is verified does not depend on the candidate drawn, so their tree's shape
        must not depend on what was drawn."""
        a, dev, k = len(lengths), self.device, width
        base = torch.tensor(lengths, device=dev)
        ids, logq = self._static(self._pick(root_logp.unsqueeze(1), k, sampled, generators), sampled)  # [A, 1, k]
        all_tok = torch.cat([torch.tensor(last, device=dev).view(a, 1), ids[:, 0]], dim=1)
        all_par = torch.cat([torch.full((a, 1), -1, dtype=torch.long, device=dev),
                             torch.zeros(a, k, dtype=torch.long, device=dev)], dim=1)
        all_score = torch.cat([torch.zeros(a, 1, device=dev), logq[:, 0].float().cummin(dim=-1).values], dim=1)
        probs = {0: (None, root_logp.exp())} if sampled else None
        frontier = torch.arange(1, 1 + k, device=dev).expand(a, k)  # node ids of the last depth's best
        frontier_score = all_score[:, 1:]
        frontier_hidden = self.root[rows_t].unsqueeze(1).expand(a, k, -1)
        anc = torch.zeros(a, 1 + k, 0, dtype=torch.bool, device=dev)  # node -> this round's draft slots it sees
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(a, k, k)
        for d in range(1, depth):
            s = anc.shape[-1]
            # one head row per frontier node, seeing its ancestors' rows and itself
            own = torch.cat([anc.gather(1, frontier.unsqueeze(-1).expand(a, k, s)), eye], dim=-1)  # [A, k, s + k]
            hidden = self._row_forward(rows_t, all_tok.gather(1, frontier), frontier_hidden,
                                       (base + d - 1).view(a, 1).expand(a, k), own)  # [A, k, d]
            logp = self._draft_dist(hidden.reshape(a * k, -1),
                                    [(i * k + j, p) for i, p in sampled for j in range(k)]).view(a, k, -1)
            if probs is not None:
                for j in range(k):
                    probs[(d, j)] = (frontier[:, j], logp[:, j].exp())
            cid, clogq = self._static(self._pick(logp, k, sampled, generators), sampled)  # [A, k, k]
            child_score = frontier_score.unsqueeze(-1) + clogq.float().cummin(dim=-1).values
            count = all_tok.shape[1]
            anc = torch.cat([torch.cat([anc, torch.zeros(a, anc.shape[1], k, dtype=torch.bool, device=dev)], dim=-1),
                             own.unsqueeze(2).expand(a, k, k, s + k).reshape(a, k * k, s + k)], dim=1)
            all_tok = torch.cat([all_tok, cid.reshape(a, -1)], dim=1)
            all_par = torch.cat([all_par, frontier.unsqueeze(-1).expand(a, k, k).reshape(a, -1)], dim=1)
            all_score = torch.cat([all_score, child_score.reshape(a, -1)], dim=1)
            best = torch.topk(child_score.reshape(a, -1), k, dim=-1)
            frontier = count + best.indices
            frontier_score = best.values
            frontier_hidden = hidden.gather(1, (best.indices // k).unsqueeze(-1).expand(a, k, hidden.shape[-1]))
        return self._select(all_tok, all_par, all_score, budget, probs, a)

    @staticmethod
    def _static(picked, sampled):
        ids, logq = picked
        if sampled:
            prior = torch.tensor(RANK_PRIOR[:logq.shape[-1]] + [RANK_PRIOR[-1]] * max(0, logq.shape[-1] - len(RANK_PRIOR)),
                                 device=logq.device).log()
            logq = logq.clone()
            for i, _ in sampled:
                logq[i] = prior
        return ids, logq

    def _select(self, all_tok, all_par, all_score, budget, probs, a):
        """The root and the `budget` best nodes (ties: earlier created first, so parents and earlier-drawn
        siblings come before), renumbered in creation order (parents before children)."""
        total = all_tok.shape[1] - 1
        n = min(budget, total)
        order = torch.arange(total, device=all_tok.device, dtype=torch.float64)
        # score first, creation index second: scores are float32, so scale the index below their spacing
        key = all_score[:, 1:].double() - order * 1e-12
        keep = torch.topk(key, n, dim=-1).indices.sort(dim=-1).values + 1  # node ids, creation order
        keep = torch.cat([torch.zeros(a, 1, dtype=torch.long, device=keep.device), keep], dim=1)
        tokens = all_tok.gather(1, keep)
        par_cpu, keep_cpu = all_par.gather(1, keep).cpu().tolist(), keep.cpu().tolist()
        parents = []
        for r in range(a):
            index = {node: i for i, node in enumerate(keep_cpu[r])}
            parents.append([-1] + [index[p] for p in par_cpu[r][1:]])
        draft_probs = None
        if probs is not None:
            v = probs[0][1].shape[-1]
            draft_probs = torch.zeros(a, n + 1, v)
            draft_probs[:, 0] = probs[0][1].cpu()
            for key_, value in probs.items():
                if key_ == 0:
                    continue
                node, dist = value
                node, dist = node.cpu().tolist(), dist.cpu()
                for r in range(a):
                    if node[r] in keep_cpu[r]:
                        draft_probs[r, keep_cpu[r].index(node[r])] = dist[r]
        return Proposal(parents, tokens, draft_probs)


# --- the decoding loop --------------------------------------------------------------------------

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


def check_mode(mode: str, draft_length: int, draft_width: int) -> None:
    if mode not in ("greedy", "beam", "auto"):
        raise ValueError(f"speculative mode must be greedy, beam or auto here, got {mode!r}")
    for name, value in (("length", draft_length), ("width", draft_width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"draft {name} must be an integer >= 1, got {value!r}")


def check_request(request: Request, context_length: int) -> None:
    """Raise (one line) for a request speculative decoding cannot take."""
    if not request.prompt_ids:
        raise ValueError("speculative decoding needs a prompt of at least one token")
    if len(request.prompt_ids) >= context_length:
        raise MoedeskError(f"prompt has {len(request.prompt_ids)} tokens; the context is {context_length}")
    if request.grammar is not None:
        raise MoedeskError("speculative decoding does not take a response_format")


class Speculator:
    """Speculative decoding of a batch of requests over one model, in a KV cache of its own."""

    def __init__(self, model, device, dtype, context_length: int, eos_token_ids=(), tokenizer=None, on_oom=None,
                 graphs=None):
        """graphs: replay target forwards from CUDA graphs over this speculator's cache (engine.generation.
        cuda_graphs): None where the device wants them (graphs_wanted), True/False, or a factory
        (model, cache) -> GraphedDecode (tests inject capture=False segments on the CPU)."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.context_length = context_length
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer is not None else frozenset())
        self.on_oom = on_oom
        self.cache: KVCache | None = None
        if graphs is None:
            from moedesk.engine.generation.cuda_graphs import graphs_wanted

            graphs = graphs_wanted(self.device)
        self.use_graphs = graphs
        self.graphs = None  # made with the cache, which its graphs read

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
        if self.cache is None:
            self.cache = self._retrying(lambda: KVCache(self.model.cfg, rows, length, self.dtype, self.device))
            if self.use_graphs:
                from moedesk.engine.generation.cuda_graphs import GraphedDecode

                make = self.use_graphs if callable(self.use_graphs) else GraphedDecode
                self.graphs = make(self.model, self.cache)
        else:
            # Reallocating moves the tensors; the graphs see that (their cache key) and capture again.
            self._retrying(lambda: self.cache.ensure(rows, length))

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
        out = self._retrying(lambda: self.model(tokens.to(self.device), positions.to(self.device), self.cache,
                                                executor, rows=where, logits_at=last.to(self.device),
                                                features=drafter.feature_keys))
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
        out = self._target(tokens, positions, executor, rows, mask, slots, drafter.feature_keys)
        logits, hidden = out if drafter.feature_keys else (out, None)
        return logits, (drafter.combine(hidden) if hidden is not None else None)

    def graph_captures(self) -> int:
        """CUDA graph shapes captured so far over this speculator's cache, and forwards left eager until their
        shape recurs (GraphedDecode.warmups): each a new shape's one-off cost (0 without graphs)."""
        return self.graphs.captures + self.graphs.warmups if self.graphs is not None else 0

    def _target(self, tokens, positions, executor, rows, mask, slots, features):
        """The target's forward over [A, T] tokens: replayed from CUDA graphs where they are on and the shape is
        captured (a γ=0 round is the plain decode step's graphs), else eagerly."""
        out = None
        if self.graphs is not None:
            out = self.graphs.forward(tokens, positions, executor, rows, mask=mask, slots=slots, features=features)
        if out is None:
            out = self.model(tokens, positions, self.cache, executor, rows=rows, mask=mask, slots=slots,
                             features=features)
        return out

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
        moves = [(i, k + 1, node) for i, path in enumerate(paths) for k, node in enumerate(path) if node != k + 1]
        if not moves:
            return
        rows = torch.tensor([active[i].index for i, _, _ in moves], device=self.device)
        dst = torch.tensor([active[i].length + k for i, k, _ in moves], device=self.device)
        src = torch.tensor([active[i].length + node for i, _, node in moves], device=self.device)
        for t in self.cache.k + self.cache.v:
            t[rows, dst] = t[rows, src]

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
            if token in self.eos and not r.params.ignore_eos:
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

    def _retrying(self, step):
        return retrying_oom(step, self.on_oom, "use a shorter draft or a smaller batch")



class SpeculativeBatch:
    """Rounds of speculative decoding over rows that come and go, in one Speculator's cache: `admit` prefills
    newcomers into free rows (one forward), `round` drafts, verifies and accepts for every running row (one
    target forward), `release` frees a finished row for the next newcomer. Speculator.run is this with every
    request admitted at once; the scheduler's SpeculativeJob admits requests as they arrive.

    drafter_factory(batch, capacity) makes the drafter at the first admit; a drafter with `grow(batch)` (the
    EAGLE one) gets more rows when newcomers need them, one without keeps what it was made with."""

    def __init__(self, spec: Speculator, drafter_factory, mode: str, draft_length: int, width: int,
                 budget: int | None, costs, capacity: int):
        self.spec, self.factory = spec, drafter_factory
        self.mode, self.draft_length, self.width = mode, draft_length, width
        self.budget = budget or draft_length * width
        self.nodes = max(self.budget, draft_length * width)
        self.costs, self.capacity = costs, capacity
        self.drafter = None
        self.rows: list[_Row | None] = []
        self.stats = RunStats(mode)
        self.alpha_counts = [0, 0]  # accepted, tested (auto's running acceptance)
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
            gamma = auto_gamma(self.costs, len(active), acceptance_estimate(accepted, tested), self.draft_length,
                               self.ledger, tested, horizon)
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
                                           1 + (self.alpha_counts[0] - accepted) / len(active))

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
        logits, feats = spec._retrying(lambda: spec._verify(active, proposal, executor, drafter))
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
        logits, feats = spec._retrying(lambda: spec._verify(active, proposal, executor, drafter))
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



# --- entry points -------------------------------------------------------------------------------

def _graphs_like(graphs):
    """The speculator's graphs as the engine's plain decode has them: none, or GraphedDecode over its own cache
    that captures (or runs the segments eagerly) as the engine's does."""
    if graphs is None:
        return False
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    return lambda model, cache: GraphedDecode(model, cache, capture=graphs.capture)


def eagle_factory(head, target_layers: int):
    return lambda batch, capacity: EagleDrafter(head, target_layers, batch, capacity)


def oracle_factory(references: list[list[int]], corruption: float, vocab_size: int, seed: int = 0):
    """A drafter factory proposing `references[i]` for request i, corrupted at the given rate."""
    return lambda batch, capacity: OracleDrafter(references, corruption, vocab_size, seed)


# --- the engine's entry: drafts from a head folder, auto's measured step times -------------------

STEP_TIMES_FORMAT = 2  # 2: timed through CUDA graphs where the engine's forwards replay them
MEASURED_BATCHES = (1, 2, 4, 8, 16, 32)


class RunningCosts:
    """Measured target step times, scaled to what this run's rounds take, plus the draft's cost per drafted
    token as this run measures it.

    The table is the best of 3 bare forwards; a run's rounds also accept, compact and stream, on a machine
    whose memory bandwidth varies from run to run. On the GPU box (Mixtral shape, B = 32) a round verifying 4
    drafts took 335 ms against the table's 260, and auto, pricing drafts by the table, speculated at 0.87x
    plain. So each round's own time (verify to streamed tokens) is divided by what the table says it should
    take, a running ratio for rounds that verify drafts and one for rounds that draft nothing, and verifying
    is priced at the table times how much more the first ratio is than the second (never less than the
    table: a machine slower all round, or plain rounds not seen yet, must not make drafting look cheaper;
    scaling plain rounds up instead had auto draft at 0.83x on the box at B = 1)."""

    def __init__(self, target_ms: dict):
        self.table = perf_model.MeasuredCosts(target_ms)
        self.draft_token_ms: float = 0.0  # 0 until a round drafts: optimistic, so auto tries once
        self.scale = {False: 1.0, True: 1.0}  # observed / table: rounds that draft nothing, rounds that verify
        self.rounds = {False: 0, True: 0}
        self._table_ms: dict = {}  # (B, k) -> the table's T(B, k): interpolated once, asked for every round

    def _table(self, batch: int, k: int) -> float | None:
        key = (batch, k)
        if key not in self._table_ms:
            self._table_ms[key] = self.table.ar_ms(batch) if k == 1 else self.table.verify_ms(batch, k - 1)
        return self._table_ms[key]

    def observe_draft(self, ms: float, tokens: int) -> None:
        if tokens:
            per = ms / tokens
            self.draft_token_ms = per if not self.draft_token_ms else 0.8 * self.draft_token_ms + 0.2 * per

    def observe_round(self, batch: int, gamma: int, ms: float) -> None:
        """A round of `batch` rows and `gamma` drafts each took `ms` from its verify forward to its last token."""
        table = self._table(batch, gamma + 1)
        if not table or ms <= 0:
            return
        side, ratio = gamma > 0, ms / table
        self.scale[side] = ratio if not self.rounds[side] else 0.7 * self.scale[side] + 0.3 * ratio
        self.rounds[side] += 1

    def ar_ms(self, batch):
        return self._table(batch, 1)

    def verify_ms(self, batch, gamma):
        t = self._table(batch, gamma + 1)
        return None if t is None else t * max(1.0, self.scale[True] / self.scale[False])

    def draft_ms(self, batch):
        return self.draft_token_ms

    def reject_ms(self, batch):
        return 0.0


def measure_step_times(model, executor, cfg, device, dtype, batches, max_k: int, prompt: int = 32,
                       repeat: int = 3, graphs=None) -> dict[str, float]:
    """T(B, k) in ms: one forward of B sequences with k new tokens each after a `prompt`-token prefix (the
    best of `repeat`), as "B,k" keys. Random tokens: what is timed is where the experts are and how many
    distinct ones the tokens reach, which random routing over-estimates only slightly.

    graphs: as Speculator takes it (None: where the device wants CUDA graphs). The forwards are then replayed
    from graphs captured for each shape, as plain decode steps and speculative verify forwards run, so auto
    prices what runs: eager forwards paid ~10-12 ms of kernel launches per step on the H100 box that the
    graphed plain step does not."""
    if graphs is None:
        from moedesk.engine.generation.cuda_graphs import graphs_wanted

        graphs = graphs_wanted(torch.device(device))
    if graphs and not callable(graphs):
        from moedesk.engine.generation.cuda_graphs import GraphedDecode

        graphs = GraphedDecode
    out = {}
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        cache = KVCache(cfg, b, prompt + max_k, dtype, device)
        tokens = torch.randint(3, cfg.vocab_size, (b, prompt + max_k), generator=gen).to(device)
        positions = torch.arange(prompt + max_k, device=device).expand(b, -1)
        model(tokens[:, :prompt], positions[:, :prompt], cache, executor)
        graphed = graphs(model, cache) if graphs else None
        if graphed is not None:
            graphed.capture_after = 1  # every shape here is timed again at once

        def forward(k):
            args = tokens[:, prompt:prompt + k], positions[:, prompt:prompt + k]
            if graphed is None or graphed.forward(*args, executor) is None:
                model(*args, cache, executor)

        for k in range(1, max_k + 1):
            if graphed is not None:
                forward(k)  # captures: not what a step costs
            best = float("inf")
            for _ in range(repeat):
                synchronize(device)
                t0 = time.perf_counter()
                forward(k)
                synchronize(device)
                best = min(best, time.perf_counter() - t0)
            out[f"{b},{k}"] = 1000 * best
        if graphed is not None:
            graphed.release()
    return out


def engine_step_times(engine, batch: int, max_gamma: int, refresh: bool = False) -> dict[tuple[int, int], float]:
    """The engine's T(B, k) for B up to `batch` (powers of two, and `batch`) and k up to max_gamma + 1, measured
    once per machine, model, device, dtype and placement and cached beside the expert profile."""
    import hashlib
    import json
    from pathlib import Path

    from moedesk.engine.load.demo import cache_root
    from moedesk.engine.hardware import machine_fingerprint
    from moedesk.engine.json_cache import cached_json

    batches = sorted({b for b in MEASURED_BATCHES if b <= batch} | {batch})
    placement = engine.orchestra.summary() if engine.orchestra is not None else {}
    graphs = _graphs_like(getattr(engine, "graphs", None))  # as the job's Speculator will run its forwards
    raw = json.dumps([STEP_TIMES_FORMAT, machine_fingerprint(), engine.name, str(engine.device), str(engine.dtype),
                      torch.get_num_threads(), json.dumps(placement, sort_keys=True, default=str), batches,
                      max_gamma + 1, bool(graphs)])
    key = hashlib.sha256(raw.encode()).hexdigest()[:16]
    measured = cached_json(Path(cache_root()) / f"speculative-steps-{key}.json",
                           lambda: measure_step_times(engine.model, engine.executor, engine.config, engine.device,
                                                      engine.dtype, batches, max_gamma + 1, graphs=graphs), refresh)
    return {tuple(int(x) for x in k.split(",")): float(v) for k, v in measured.items()}


def draft_head(engine, path):
    """The EAGLE head at `path` for this engine's model, loaded once and kept on the engine."""
    from moedesk.engine.speculative.eagle import load_eagle_head

    heads = engine.__dict__.setdefault("_speculative_heads", {})
    key = str(path)
    if key not in heads:
        head = load_eagle_head(path, target_embed=engine.model.embed.weight.detach(),
                               target_lm_head=engine.model.lm_head.weight.detach(), dtype=engine.dtype,
                               device=engine.device)
        if head.cfg.vocab_size != engine.config.vocab_size:
            raise MoedeskError(f"{path}: the draft head's vocabulary ({head.cfg.vocab_size}) is not the model's "
                               f"({engine.config.vocab_size})")
        heads[key] = head.eval().requires_grad_(False)  # only ever run: no autograd graphs kept by its caches
    return heads[key]


def speculate(engine, requests: list[Request], draft, mode: str = "greedy", draft_length: int = 4,
              draft_width: int = 4, budget: int | None = None) -> list[Completion]:
    """Complete `requests` together with speculative decoding (Engine.speculate documents it): submitted to the
    engine's scheduler at once, so they verify as one batch, beside whatever else it runs."""
    options = SpeculativeOptions(mode, draft, draft_length, draft_width, budget)
    if not requests:
        return []
    return engine.complete(requests, decoding=options)


def generate_speculative(engine, requests, batch_size: int, draft, mode: str = "greedy", draft_length: int = 4,
                         draft_width: int = 4, budget: int | None = None):
    """Engine.generate's interface with speculative decoding: at most `batch_size` requests in the speculative
    batch at once, a finished one's row taken by the next (continuous batching, as plain generate does), each
    completion yielded as it finishes."""
    return engine.generate(requests, batch_size=batch_size,
                           decoding=SpeculativeOptions(mode, draft, draft_length, draft_width, budget))


# --- the scheduler's job ------------------------------------------------------------------------

SPECULATIVE_ROWS = 16  # requests one speculative job holds when the caller sets no limit (as a group would)


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request decoded speculatively (Engine.submit's `decoding`). draft: an EAGLE head folder (loaded once per
    engine) or a drafter factory (`oracle_factory`); mode, draft_length, draft_width, budget as Engine.speculate
    takes them."""

    mode: str = "greedy"
    draft: object = None
    draft_length: int = 4
    draft_width: int = 4
    budget: int | None = None

    def __post_init__(self):
        check_mode(self.mode, self.draft_length, self.draft_width)
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft head (an EAGLE head folder)")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"the draft budget must be an integer >= 1, got {self.budget!r}")

    @property
    def width(self) -> int:
        return self.draft_width if self.mode == "beam" else 1

    @property
    def key(self) -> tuple:
        """Requests of equal keys share a job, so they verify in one forward: the same head and draft shape."""
        draft = self.draft if callable(self.draft) else str(self.draft)
        return ("speculative", draft, self.mode, self.draft_length, self.width, self.budget)


class SpeculativeKind:
    """engine.generation.scheduler.JobKind for speculative requests: one job per draft configuration, holding
    up to `limit` requests that join and leave between its rounds."""

    def __init__(self, engine, options: SpeculativeOptions, limit: int = SPECULATIVE_ROWS):
        self.engine, self.options, self.limit = engine, options, max(1, limit)
        self.key = options.key

    def make(self) -> "SpeculativeJob":
        return SpeculativeJob(self.engine, self.options, self.limit)


class SpeculativeJob:
    """Speculative requests of one configuration, stepped by the scheduler's decode thread
    (engine.generation.scheduler.Job): each step prefills the newcomers together and runs one round over
    every running request, whose accepted tokens then stream one by one, as plain decoding's do.

    The draft head is loaded, auto's step times measured (cached per machine) and a Speculator (its KV cache)
    taken from the engine's idle ones at the first step, on the decode thread. In auto mode, requests that
    start a job go back to the plain batch when not even a good draft would pay at their batch size, or their run
    is too short to afford a probe (auto_decodes_plainly): decoding them plainly is never slower."""

    def __init__(self, engine, options: SpeculativeOptions, limit: int):
        self.engine, self.options, self.limit = engine, options, limit
        self.plain: list = []
        self.fresh: list = []
        self.rows: dict = {}  # handle -> _Row, in admission order
        self.batch: SpeculativeBatch | None = None
        self.spec: Speculator | None = None
        self.decided = options.mode != "auto"  # whether drafting can pay here was decided

    def admit(self, handle) -> None:
        check_request(handle.request, self.engine.context_length)
        self.fresh.append(handle)

    def _start(self, first: list) -> None:
        engine, o = self.engine, self.options
        factory = o.draft if callable(o.draft) else eagle_factory(draft_head(engine, o.draft), engine.config.num_layers)
        costs = RunningCosts(engine_step_times(engine, self.limit, o.draft_length)) if o.mode == "auto" else None
        idle = engine.__dict__.setdefault("_speculators", [])
        self.spec = idle.pop() if idle else Speculator(engine.model, engine.device, engine.dtype,
                                                       engine.context_length, engine.config.eos_token_ids,
                                                       engine.tokenizer, on_oom=engine._on_oom,
                                                       graphs=_graphs_like(engine.graphs))
        self.spec.eos = frozenset(engine.config.eos_token_ids) | (
            engine.tokenizer.eos_token_ids if engine.tokenizer is not None else frozenset())
        room = (o.draft_length + 1) * o.width + 8
        # As a run sizes it for its requests, capped at a context's worth: rows come and go, so the drafter
        # compacts and grows its slots as it needs (EagleDrafter.grow) instead of holding a worst case.
        capacity = min(max(len(h.request.prompt_ids) for h in first)
                       + (o.draft_length + 1) * max(h.request.params.max_new_tokens for h in first),
                       engine.context_length) + room

        def drafter(batch, capacity_):
            made = factory(batch, capacity_)
            if hasattr(made, "draft_room"):
                made.draft_room = room
            return made

        self.batch = SpeculativeBatch(self.spec, drafter, o.mode, o.draft_length, o.width, o.budget, costs, capacity)

    def step(self):
        engine = self.engine
        fresh, self.fresh = self.fresh, []
        if fresh and self.batch is None:
            self._start(fresh)
        if fresh and not self.decided:
            self.decided = True
            o = self.options
            horizon = max(h.request.params.max_new_tokens for h in fresh)
            if auto_decodes_plainly(self.batch.costs, len(fresh), o.draft_length, horizon):
                for handle in fresh:
                    handle.extra_stats["speculative"] = {"mode": "auto", "plain": True}
                self.plain.extend(fresh)
                return []
        executor = engine.executor
        if fresh:
            for handle, row in zip(fresh, self.batch.admit([h.request for h in fresh], executor, streamed=True)):
                self.rows[handle] = row
        if self.batch is not None and self.batch.active():
            self.batch.round(executor)
        return self._events(executor)

    def _events(self, executor) -> list:
        events = []
        for handle, row in list(self.rows.items()):
            for token, text in row.streamed:
                events.append((handle, token, text, None))
            row.streamed.clear()
            if row.finish_reason is not None:
                events.append((handle, None, row.text, self._finish(handle, executor)))
        return events

    def _finish(self, handle, executor) -> Completion:
        row = self.rows.pop(handle)
        done = self.batch.completion(row, executor)
        self.batch.release(row)
        return done

    def drop(self, handle) -> Completion:
        if handle in self.fresh:
            self.fresh.remove(handle)
        row = self.rows.get(handle)
        if row is None:
            return Completion(tag=handle.request.tag, token_ids=[], text="", finish_reason="cancelled",
                              prompt_tokens=len(handle.request.prompt_ids), stats={})
        row.finish_reason = "cancelled"
        return self._finish(handle, self.engine.executor)

    def close(self) -> None:
        if self.spec is not None:
            self.engine.__dict__.setdefault("_speculators", []).append(self.spec)
            self.spec = None

