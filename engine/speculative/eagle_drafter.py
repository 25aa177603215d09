"""The EAGLE drafter: an EAGLE-1/2/3 head (engine.speculative.eagle) drafting chains or EAGLE-2 trees for a
batch, with its own KV cache whose slots the rows share (holes masked); and the engine's draft heads, loaded
once from a head folder (`draft_head`).
"""
from __future__ import annotations

import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.speculative.proposal import Proposal, chain_parents
from moedesk.engine.speculative.rejection import processed_probs


# How likely a sampled tree's k-th drawn child is to be accepted, for shaping the tree without looking at
# what was drawn (roughly what EAGLE-2 trees accept by rank); strictly decreasing, so siblings keep their
# draw order and a child never outranks its parent.
RANK_PRIOR = [0.6, 0.2, 0.08, 0.04, 0.02, 0.01, 0.005, 0.0025]


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


def eagle_factory(head, target_layers: int):
    return lambda batch, capacity: EagleDrafter(head, target_layers, batch, capacity)


def draft_head(engine, path):
    """The EAGLE head at `path` for this engine's model, loaded once and kept on the engine."""
    from moedesk.engine.speculative.eagle import load_eagle_head

    heads = engine.draft_heads
    key = str(path)
    if key not in heads:
        head = load_eagle_head(path, target_embed=engine.model.embed.weight.detach(), dtype=engine.dtype,
                               device=engine.device)
        # Shared, not copied to the engine's device: on a spread it lives on the last GPU, where the plan counts it
        # (a copy on GPU 0 would be memory no plan holds); on one GPU it is the same tensor as ever.
        head.share_target_head(engine.model.lm_head)
        if head.cfg.vocab_size != engine.config.vocab_size:
            raise MoedeskError(f"{path}: the draft head's vocabulary ({head.cfg.vocab_size}) is not the model's "
                               f"({engine.config.vocab_size})")
        heads[key] = head.eval().requires_grad_(False)  # only ever run: no autograd graphs kept by its caches
    return heads[key]

