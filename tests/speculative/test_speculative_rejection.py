"""Verification of drafts (engine.speculative.rejection): greedy is exact; sampling keeps the target's
distribution exactly.

The statistical tests generate many short sequences with a tiny vocabulary through speculative
steps and compare the joint distribution of the first tokens with the target's by Pearson's
chi-square (scipy.stats.chisquare). Each comparison fails when its p-value is below ALPHA = 1e-4:
were the sampler exact, a given check would fail by chance once in 10,000 seeds (the seeds are fixed,
so a run is reproducible). The same statistic rejects a sampler told the wrong draft distribution,
which shows the sample sizes are large enough to see a real error.
"""
import itertools
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from moedesk.engine.speculative.rejection import greedy_chain, greedy_tree, sample_chain, sample_tree

ALPHA = 1e-4
V = 5

# --- greedy -----------------------------------------------------------------------------------


def _logits_with_argmax(best: list[int], v: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(best), v, generator=g)
    for i, b in enumerate(best):
        logits[i, b] = logits[i].max() + 1.0
    return logits


def test_greedy_chain_keeps_the_longest_matching_prefix_then_the_targets_token():
    target_best = [3, 1, 4, 1, 5]  # argmax after the last accepted token and after each of 4 drafts
    logits = _logits_with_argmax(target_best)
    for drafts, n in (([3, 1, 4, 1], 4), ([3, 1, 0, 1], 2), ([0, 1, 4, 1], 0), ([3, 1, 4, 2], 3)):
        verdict = greedy_chain(torch.tensor(drafts), logits)
        assert int(verdict.accepted) == n
        assert int(verdict.next_token) == target_best[n]
        # exactly what plain greedy decoding emits, as far as this step goes
        assert verdict.tokens(torch.tensor(drafts)) == target_best[: n + 1]


def test_greedy_chain_batched_rows_are_independent():
    best = [[2, 2, 2], [0, 1, 2]]
    logits = torch.stack([_logits_with_argmax(b, seed=i) for i, b in enumerate(best)])
    drafts = torch.tensor([[2, 2], [0, 0]])
    verdict = greedy_chain(drafts, logits)
    assert verdict.accepted.tolist() == [2, 1]
    assert verdict.next_token.tolist() == [2, 1]
    with pytest.raises(ValueError):
        greedy_chain(drafts, logits[:, :2])


def test_greedy_tree_follows_the_targets_argmax():
    #        0 (root)
    #      /   \
    #     1(a)  2(b)          a=3, b=1
    #    / \      \
    #  3(4) 4(2)   5(0)
    #   |
    #  6(6)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([9, 3, 1, 4, 2, 0, 6])
    # target argmax after each node
    best = [1, 5, 0, 6, 3, 3, 2]
    verdict = greedy_tree(parents, tokens, _logits_with_argmax(best))
    assert verdict.path[: int(verdict.accepted)].tolist() == [2, 5]  # root wants 1 (node 2), node 2 wants 0 (node 5)
    assert int(verdict.next_token) == 3
    assert verdict.tokens(tokens) == [1, 0, 3]
    best = [3, 4, 0, 6, 3, 3, 2]  # 3 -> node 1, then 4 -> node 3, then 6 -> node 6, then 2
    verdict = greedy_tree(parents, tokens, _logits_with_argmax(best))
    assert verdict.tokens(tokens) == [3, 4, 6, 2]
    best = [7 - 1, 4, 0, 6, 3, 3, 2]  # root wants 6: no child has it
    verdict = greedy_tree(parents, tokens, _logits_with_argmax(best))
    assert int(verdict.accepted) == 0 and verdict.tokens(tokens) == [6]
    # batched: both trees at once give the same answers
    many = torch.stack([_logits_with_argmax(b) for b in ([1, 5, 0, 6, 3, 3, 2], [3, 4, 0, 6, 3, 3, 2])])
    verdict = greedy_tree(parents, tokens.expand(2, -1), many)
    assert verdict.accepted.tolist() == [2, 3] and verdict.next_token.tolist() == [3, 2]
    # a chain is a tree whose nodes each have one child
    chain = greedy_tree(torch.tensor([-1, 0, 1, 2]), torch.tensor([0, 3, 1, 0]), _logits_with_argmax([3, 1, 4, 1]))
    assert chain.tokens(torch.tensor([0, 3, 1, 0])) == [3, 1, 4]
    with pytest.raises(ValueError):
        greedy_tree(torch.tensor([-1, 2, 0]), torch.tensor([0, 1, 2]), _logits_with_argmax([0, 0, 0]))


# --- sampling: the distribution ---------------------------------------------------------------

def _dist(*weights) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w / w.sum()


# The target: a first-token distribution and a next-token table (each row the distribution after a
# token), so that drafts and the target disagree in a context-dependent way. Token 4 has no target
# mass after token 0.
TARGET_FIRST = _dist(0.30, 0.25, 0.20, 0.15, 0.10)
TARGET_NEXT = torch.stack([_dist(0.4, 0.3, 0.2, 0.1, 0.0), _dist(0.1, 0.2, 0.3, 0.2, 0.2),
                           _dist(0.2, 0.2, 0.2, 0.2, 0.2), _dist(0.5, 0.1, 0.1, 0.1, 0.2),
                           _dist(0.05, 0.15, 0.3, 0.3, 0.2)])


def _drafts():
    g = torch.Generator().manual_seed(11)
    dirichlet = torch.distributions.Dirichlet(torch.ones(V, dtype=torch.float64))
    torch.manual_seed(11)
    random_next = dirichlet.sample((V,))
    no_mass_next = TARGET_NEXT.clone()
    no_mass_next[:, 2] = 0.0  # zero mass where the target has mass
    no_mass_next[:, 4] += 0.2  # and mass where it (after token 0) has none
    no_mass_next /= no_mass_next.sum(-1, keepdim=True)
    return {
        "uniform": (torch.full((V,), 1.0 / V, dtype=torch.float64), torch.full((V, V), 1.0 / V, dtype=torch.float64)),
        "equal": (TARGET_FIRST, TARGET_NEXT),
        "zero_where_target_has_mass": (_dist(0.5, 0.5, 0, 0, 0), no_mass_next),
        "peaked_wrong": (_dist(0.01, 0.01, 0.01, 0.01, 0.96), torch.eye(V, dtype=torch.float64).roll(1, 1) * 0.9 + 0.02),
        "random": (dirichlet.sample(), random_next),
    }


def _target_joint(length: int) -> np.ndarray:
    joint = np.zeros((V,) * length)
    for seq in itertools.product(range(V), repeat=length):
        p = float(TARGET_FIRST[seq[0]])
        for a, b in zip(seq, seq[1:]):
            p *= float(TARGET_NEXT[a, b])
        joint[seq] = p
    return joint


def _emit(out, filled, last, seq, count):
    """Append each row's first `count` tokens of `seq` to `out` (rows already full stay as they are)."""
    length = out.shape[1]
    for j in range(seq.shape[1]):
        pos = filled + j
        write = (j < count) & (pos < length)
        rows = write.nonzero().squeeze(1)
        out[rows, pos[rows]] = seq[rows, j]
        last[rows] = seq[rows, j]
    filled.copy_(torch.clamp(filled + count, max=length))


def _generate_chain(draft, gamma: int, rows: int, length: int, seed: int, claimed_draft=None) -> np.ndarray:
    """`rows` sequences of `length` tokens, each produced by speculative steps of `gamma` drafts."""
    draft_first, draft_next = draft
    claimed_first, claimed_next = claimed_draft or draft
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, length), -1, dtype=torch.int64)
    filled = torch.zeros(rows, dtype=torch.int64)
    last = torch.full((rows,), -1, dtype=torch.int64)  # -1: nothing generated yet
    while int(filled.min()) < length:
        # draft γ tokens from each row's context
        drafts, draft_rows, claimed_rows, target_rows = [], [], [], []
        prev = last
        for _ in range(gamma):
            q = torch.where((prev < 0).unsqueeze(1), draft_first, draft_next[prev.clamp_min(0)])
            q_claimed = torch.where((prev < 0).unsqueeze(1), claimed_first, claimed_next[prev.clamp_min(0)])
            p = torch.where((prev < 0).unsqueeze(1), TARGET_FIRST, TARGET_NEXT[prev.clamp_min(0)])
            x = torch.multinomial(q, 1, generator=g).squeeze(1)
            drafts.append(x), draft_rows.append(q), claimed_rows.append(q_claimed), target_rows.append(p)
            prev = x
        target_rows.append(TARGET_NEXT[prev])
        drafts = torch.stack(drafts, 1)
        verdict = sample_chain(drafts, torch.stack(claimed_rows, 1), torch.stack(target_rows, 1), g)
        seq = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
        seq.scatter_(1, verdict.accepted.unsqueeze(1), verdict.next_token.unsqueeze(1))
        _emit(out, filled, last, seq, verdict.accepted + 1)
    return out.numpy()


def _check(samples: np.ndarray, expected: np.ndarray) -> float:
    """p-value of the samples' joint counts against the expected joint; cells the target never
    produces must never appear."""
    counts = np.zeros(expected.shape)
    np.add.at(counts, tuple(samples.T), 1)
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token the target gives no probability was emitted"
    return chisquare(counts[~zero], expected[~zero] * len(samples)).pvalue


@pytest.mark.parametrize("name", ["uniform", "equal", "zero_where_target_has_mass", "peaked_wrong", "random"])
def test_sampled_chain_output_is_distributed_as_the_target(name):
    draft = _drafts()[name]
    samples = _generate_chain(draft, gamma=3, rows=30_000, length=2, seed=zlib.crc32(name.encode()))
    assert _check(samples, _target_joint(2)) > ALPHA


def test_sampled_chain_first_token_with_many_samples():
    # the first token alone, with more samples: a finer check of the residual at position 0
    draft = _drafts()["zero_where_target_has_mass"]
    samples = _generate_chain(draft, gamma=2, rows=100_000, length=1, seed=5)
    assert _check(samples, _target_joint(1)) > ALPHA


def test_the_chi_square_check_sees_a_wrong_sampler():
    # drafts drawn from one distribution but verified as if from another: the output is no longer
    # the target's, and the same sample size and threshold catch it
    drafts = _drafts()
    samples = _generate_chain(drafts["uniform"], gamma=3, rows=30_000, length=2, seed=3,
                              claimed_draft=drafts["peaked_wrong"])
    assert _check(samples, _target_joint(2)) < ALPHA


def test_sample_chain_all_accepted_draws_from_the_target_after_the_last_draft():
    # draft == target: every draft is accepted, and the extra token comes from the last target row
    target = torch.stack([TARGET_FIRST, TARGET_NEXT[1], TARGET_NEXT[3]]).float()
    drafts = torch.tensor([1, 3]).expand(4000, 2)
    verdict = sample_chain(drafts, target[:2].expand(4000, 2, V), target.expand(4000, 3, V),
                           torch.Generator().manual_seed(0))
    assert bool((verdict.accepted == 2).all())
    counts = np.bincount(verdict.next_token.numpy(), minlength=V)
    assert chisquare(counts, TARGET_NEXT[3].numpy() * 4000).pvalue > ALPHA


def test_sample_chain_is_reproducible_with_a_seeded_generator():
    args = (torch.tensor([[1, 2, 3]]), _dist(1, 1, 1, 1, 1).float().expand(1, 3, V),
            TARGET_NEXT[:4].float().unsqueeze(0))
    a = sample_chain(*args, generator=torch.Generator().manual_seed(7))
    b = sample_chain(*args, generator=torch.Generator().manual_seed(7))
    assert (a.accepted, a.next_token) == (b.accepted, b.next_token)


# --- sampling: trees --------------------------------------------------------------------------

# root -> 2 candidates (drawn without replacement from the draft after the root),
# each -> 2 candidates from the draft after it.
TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 2])


def _generate_tree(draft, rows: int, seed: int, claimed_draft=None) -> np.ndarray:
    """The first two tokens of `rows` sequences, each step verifying a tree of TREE_PARENTS' shape
    whose children are drawn without replacement from the draft at their parent."""
    draft_first, draft_next = draft
    claimed_first, claimed_next = claimed_draft or draft
    g = torch.Generator().manual_seed(seed)
    n = len(TREE_PARENTS)
    out = torch.full((rows, 2), -1, dtype=torch.int64)
    filled = torch.zeros(rows, dtype=torch.int64)
    last = torch.full((rows,), -1, dtype=torch.int64)
    while int(filled.min()) < 2:
        tokens = torch.zeros(rows, n, dtype=torch.int64)
        tokens[:, 0] = last.clamp_min(0)
        q_nodes = torch.zeros(rows, n, V, dtype=torch.float64)
        claimed = torch.zeros(rows, n, V, dtype=torch.float64)
        p_nodes = torch.zeros(rows, n, V, dtype=torch.float64)
        for i in range(n):  # parents come first, so each node's context is known when it is reached
            ctx = last if i == 0 else tokens[:, i]
            first = (ctx < 0).unsqueeze(1) if i == 0 else torch.zeros(rows, 1, dtype=torch.bool)
            q_nodes[:, i] = torch.where(first, draft_first, draft_next[ctx.clamp_min(0)])
            claimed[:, i] = torch.where(first, claimed_first, claimed_next[ctx.clamp_min(0)])
            p_nodes[:, i] = torch.where(first, TARGET_FIRST, TARGET_NEXT[ctx.clamp_min(0)])
            kids = [j for j in range(n) if int(TREE_PARENTS[j]) == i]
            if kids:
                assert bool(((q_nodes[:, i] > 0).sum(1) >= len(kids)).all()), "the draft must have a token per child"
                tokens[:, kids] = torch.multinomial(q_nodes[:, i], len(kids), replacement=False, generator=g)
        verdict = sample_tree(TREE_PARENTS, tokens, claimed, p_nodes, g)
        seq = torch.cat([tokens.gather(1, verdict.path.clamp_min(0)), torch.zeros_like(tokens[:, :1])], 1)
        seq.scatter_(1, verdict.accepted.unsqueeze(1), verdict.next_token.unsqueeze(1))
        _emit(out, filled, last, seq, verdict.accepted + 1)
    return out.numpy()


@pytest.mark.parametrize("name", ["uniform", "equal", "zero_where_target_has_mass", "peaked_wrong", "random"])
def test_sampled_tree_output_is_distributed_as_the_target(name):
    samples = _generate_tree(_drafts()[name], rows=30_000, seed=zlib.crc32(name.encode()) + 1)
    assert _check(samples, _target_joint(2)) > ALPHA


def test_the_chi_square_check_sees_a_wrong_tree_sampler():
    drafts = _drafts()
    samples = _generate_tree(drafts["uniform"], rows=30_000, seed=3, claimed_draft=drafts["random"])
    assert _check(samples, _target_joint(2)) < ALPHA


def test_sample_tree_accepts_what_the_target_agrees_with_and_never_what_it_excludes():
    parents = torch.tensor([-1, 0, 0, 1])
    tokens = torch.tensor([[0, 2, 3, 1]]).expand(500, 4)
    same = torch.stack([_dist(1, 1, 3, 3, 1), _dist(1, 4, 1, 1, 1), _dist(1, 1, 1, 1, 1), _dist(2, 1, 1, 1, 1)]).float()
    verdict = sample_tree(parents, tokens, same.expand(500, 4, V), same.expand(500, 4, V), torch.Generator().manual_seed(1))
    # the first candidate (node 1) is accepted with probability min(1, 1) = 1, then node 3 likewise
    assert verdict.path[:, :2].tolist() == [[1, 3]] * 500 and bool((verdict.accepted == 2).all())
    excluded = same.clone()
    excluded[0] = _dist(1, 1, 0, 0, 1)  # the target gives neither root candidate (2, 3) any mass
    verdict = sample_tree(parents, tokens, same.expand(500, 4, V), excluded.expand(500, 4, V),
                          torch.Generator().manual_seed(1))
    assert bool((verdict.accepted == 0).all())
    assert set(verdict.next_token.tolist()) <= {0, 1, 4}
