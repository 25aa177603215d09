"""Speculative rounds through the CUDA-graph segments (engine.generation.cuda_graphs.GraphedDecode).

On the CPU the segments run eagerly (capture=False), which is how CI checks what the graphs replay: a round
that drafts nothing (auto's γ=0) is the plain decode step's segments, and a verify forward of k tokens per
row (a chain, or a tree with its mask and slots) through the segments gives the eager forward's logits and
features, so speculative output stays plain greedy's. Capture and replay themselves are checked on the GPU
box (tests/speculative/test_speculative_graphs_gpu.py).
"""
import pytest
import torch

from moedesk.engine.generation.cuda_graphs import GraphedDecode
from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.requests import Request
from moedesk.engine.speculative import auto, proposal, step_times
from moedesk.engine.speculative.eagle_drafter import eagle_factory
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from moedesk.engine.speculative.verification import Speculator
from tests.speculative.test_speculative_decode import PROMPTS, greedy, plain, random_head


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Counting:
    """A GraphedDecode factory whose graphs record each forward's (batch, tokens per row, went through)."""

    def __init__(self, capture_after=1):
        self.calls, self.made, self.capture_after = [], [], capture_after

    def __call__(self, model, cache):
        graphs = GraphedDecode(model, cache, capture=False, capture_after=self.capture_after)
        forward = graphs.forward

        def counted(tokens, *a, **k):
            out = forward(tokens, *a, **k)
            self.calls.append((*tokens.shape, out is not None))
            return out

        graphs.forward = counted
        self.made.append(graphs)
        return graphs


def speculate(engine, requests, factory, graphs, **kw):
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer, graphs=graphs)
    return sp.run(requests, engine.executor, factory, **kw)


def _table(batch, max_k, cost):
    return {(b, k): cost(b, k) for b in range(1, batch + 1) for k in range(1, max_k + 1)}


@pytest.mark.parametrize("draft", ["oracle", "eagle1", "eagle3"])
@pytest.mark.parametrize("offload", [False, True], ids=["in-place", "offloaded"])
def test_auto_rounds_that_draft_nothing_are_the_plain_decode_segments(draft, offload, engines, tmp_path):
    """auto priced out of drafting: every round is one plain step of the graph segments (with the features an
    EAGLE head absorbs), none eager, and the tokens are plain greedy's."""
    engine = engines("mixtral", offload)
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=n), tag=i)
                for i, (p, n) in enumerate(zip(PROMPTS, (20, 12, 6)))]
    expected = plain(engine, requests)
    factory = (oracle_factory(expected, 0.2, engine.vocab_size) if draft == "oracle" else
               eagle_factory(random_head(engine, int(draft[-1]), tmp_path / draft), engine.config.num_layers))
    costs = auto.RunningCosts(_table(3, 5, lambda b, k: 10.0 * k))  # a draft never pays
    graphs = Counting()
    done, stats = speculate(engine, requests, factory, graphs, mode="auto", draft_length=4, costs=costs)
    assert [c.token_ids for c in done] == expected
    assert {r[0] for r in stats.rounds} == {0}
    assert len(graphs.calls) == len(stats.rounds) > 0
    assert all(t == 1 and went for _, t, went in graphs.calls)  # every round: one token a row, through the segments
    assert {b for b, _, _ in graphs.calls} == {1, 2, 3}  # rows finished at different rounds
    # each batch size's shape is set up once, in the first round that runs it, and that round says so
    firsts = [i for i, r in enumerate(stats.rounds) if i == 0 or r.rows != stats.rounds[i - 1].rows]
    assert [i for i, r in enumerate(stats.rounds) if r.captured] == firsts
    assert sum(r.captured for r in stats.rounds) == graphs.made[0].captures == 3


def test_rounds_left_eager_until_their_shape_recurs_are_marked_as_one_off(engines):
    """A multi-token shape runs eagerly until seen capture_after times, then is captured: both are a new shape's
    one-off cost, which auto does not price its rounds by and a bench leaves out (Round.captured); on the GPU box
    an eager B = 16 verify round took ~5x its replay and alone cost auto 7% of a 32-token run. Later rounds of
    the shape are not marked."""
    engine = engines("mixtral", False)
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=n), tag=i)
                for i, (p, n) in enumerate(zip(PROMPTS, (20, 12, 6)))]
    expected = plain(engine, requests)
    graphs = Counting(capture_after=2)
    done, stats = speculate(engine, requests, oracle_factory(expected, 0.6, engine.vocab_size), graphs,
                            mode="greedy", draft_length=2)
    assert [c.token_ids for c in done] == expected
    assert len(graphs.calls) == len(stats.rounds)
    seen, one_off = {}, []
    for batch, tokens, went in graphs.calls:
        seen[batch, tokens] = seen.get((batch, tokens), 0) + 1
        assert went == (tokens == 1 or seen[batch, tokens] >= 2)  # eager only at a multi-token shape's first sight
        one_off.append(seen[batch, tokens] <= (1 if tokens == 1 else 2))
    assert [bool(r.captured) for r in stats.rounds] == one_off
    assert any(one_off) and not all(one_off)
    made = graphs.made[0]
    assert made.warmups == sum(1 for b, t, went in graphs.calls if not went) > 0
    assert sum(r.captured for r in stats.rounds) == made.captures + made.warmups


def _prefilled(engine, prompts, extra):
    """A cache holding the prompts (right-padded) and a copy of it."""
    longest = max(map(len, prompts))
    cache = KVCache(engine.config, len(prompts), longest + extra + 4, engine.dtype, engine.device)
    tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], device=engine.device)
    engine.model(tokens, torch.arange(longest, device=engine.device).expand(len(prompts), -1), cache, engine.executor)
    twin = KVCache(engine.config, len(prompts), cache.length, engine.dtype, engine.device)
    for a, b in zip(twin.k + twin.v, cache.k + cache.v):
        a.copy_(b)
    return cache, twin


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("rows", [False, True], ids=["slice", "rows"])
def test_verify_segments_equal_the_eager_forward(arch, shape, rows, engines):
    """k tokens per row through the segments (fixed-length attention, the tree's mask padded to the cache):
    the eager forward's logits and features, and the same keys and values written."""
    engine = engines(arch)
    cache, twin, inputs = verify_inputs(engine, shape, rows)
    features = ("final", 1)
    want, want_hidden = engine.model(*inputs[:2], cache, engine.executor, rows=inputs[2], mask=inputs[3],
                                     slots=inputs[4], features=features)
    graphs = GraphedDecode(engine.model, twin, capture=False, capture_after=1)
    got, hidden = graphs.forward(*inputs[:2], engine.executor, inputs[2], mask=inputs[3], slots=inputs[4],
                                 features=features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for key in features:
        torch.testing.assert_close(hidden[key], want_hidden[key], rtol=1e-5, atol=1e-5)
    for a, b in zip(twin.k + twin.v, cache.k + cache.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def verify_inputs(engine, shape, rows, n=5, seed=0):
    """Two equal caches holding PROMPTS, and a verify forward's (tokens, positions, rows, mask, slots): a chain of
    n tokens per row, or a tree of n nodes (two children of the root, two of its first child)."""
    dev = engine.device
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    lengths = torch.tensor([len(p) for p in prompts])
    cache, twin = _prefilled(engine, prompts, n)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, engine.vocab_size, (len(prompts), n), generator=g)
    mask = slots = None
    if shape == "chain":
        positions = lengths[:, None] + torch.arange(n)
    else:
        parents = [-1, 0, 0, 1, 1, 2, 2, 3][:n]
        positions = lengths[:, None] + torch.tensor(proposal.node_depths(parents))
        kv_len = int(lengths.max()) + n
        m = (torch.arange(kv_len)[None, None] < lengths[:, None, None]).expand(len(prompts), n, kv_len).clone()
        for i in range(len(prompts)):
            m[i, :, int(lengths[i]):int(lengths[i]) + n] = proposal.tree_mask(parents)
        mask, slots = m[:, None].to(dev), (lengths[:, None] + torch.arange(n)).to(dev)
    where = torch.arange(len(prompts), device=dev) if rows else None
    return cache, twin, (tokens.to(dev), positions.to(dev), where, mask, slots)


def test_a_new_multi_token_shape_runs_eagerly_until_it_recurs(engines):
    engine = engines("mixtral")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    cache, _ = _prefilled(engine, prompts, 3)
    graphs = GraphedDecode(engine.model, cache, capture=False, max_shapes=1)
    tokens = torch.ones(2, 3, dtype=torch.long)
    positions = torch.tensor([[len(p) + j for j in range(3)] for p in prompts])
    assert graphs.forward(tokens, positions, engine.executor) is None  # first sighting: the caller's eager forward
    assert graphs.forward(tokens, positions, engine.executor) is not None
    assert graphs.forward(tokens[:, :2], positions[:, :2], engine.executor) is None
    assert graphs.forward(tokens[:, :2], positions[:, :2], engine.executor) is None  # max_shapes held already
    assert graphs.forward(tokens[:, :1], positions[:, :1], engine.executor) is not None  # decode: at once
    assert len(graphs.captured) == 2


@pytest.mark.parametrize("offload", [False, True], ids=["in-place", "offloaded"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_speculative_greedy_through_the_segments_equals_plain_greedy(arch, offload, engines, tmp_path):
    """Chains and trees verified by the segments (after each shape's first, eager, sighting), with EAGLE heads
    (features from the segments) and an oracle that gets accepted: plain greedy's tokens."""
    engine = engines(arch, offload)
    requests = [Request(engine.tokenizer.encode(p), greedy(), tag=i) for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    drafts = {"eagle1": eagle_factory(random_head(engine, 1, tmp_path / "eagle1"), engine.config.num_layers),
              "eagle3": eagle_factory(random_head(engine, 3, tmp_path / "eagle3"), engine.config.num_layers),
              "oracle": oracle_factory(expected, 0.3, engine.vocab_size, seed=1)}
    for name, factory in drafts.items():
        for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
            graphs = Counting(capture_after=2)
            done, _ = speculate(engine, requests, factory, graphs, mode=mode, draft_length=4, draft_width=width,
                                budget=budget)
            assert [c.token_ids for c in done] == expected, (name, mode)
            through = [t for _, t, went in graphs.calls if went]
            assert through and all(t > 1 for t in through), (name, mode)  # verify forwards went through
            assert any(not went for _, _, went in graphs.calls)  # first sightings ran eagerly


def test_engine_jobs_take_the_engines_graphs_setting(engines, monkeypatch):
    """A speculative job's Speculator replays segments when the engine's plain decode does (here capture=False)."""
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=10)) for p in PROMPTS[:2]]
    expected = plain(engine, requests)
    monkeypatch.setattr(engine.runner, "graphs", GraphedDecode(engine.model, engine.cache, capture=False))
    monkeypatch.setattr(engine, "idle_speculators", [])
    done = engine.speculate(requests, oracle_factory(expected, 0.0, engine.vocab_size), mode="greedy",
                            draft_length=3)
    assert [c.token_ids for c in done] == expected
    spec = engine.idle_speculators[0]
    graphs = spec.runner.graphs
    assert isinstance(graphs, GraphedDecode) and not graphs.capture and graphs.captured
    assert engine.release_cache() and engine.idle_speculators == []  # an idle speculator's cache goes back too


@pytest.mark.parametrize("draft", ["oracle-chain", "eagle-tree"])
def test_sampling_through_the_segments_keeps_the_targets_distribution(draft, engines, tmp_path, monkeypatch):
    """The chi-square test of test_speculative_decode with every verify forward through the segments."""
    import functools

    from tests.speculative import test_speculative_decode as plain_tests

    graphs = Counting(capture_after=1)
    monkeypatch.setattr(plain_tests, "Speculator", functools.partial(Speculator, graphs=graphs))
    plain_tests.test_sampling_keeps_the_targets_distribution(draft, engines, tmp_path)
    assert graphs.calls and all(went for _, _, went in graphs.calls)


def test_auto_step_times_are_timed_through_the_graphs(engines, tmp_path, monkeypatch):
    """T(B, k) for auto times the forwards as the speculator runs them: through the graph segments where the
    engine decodes through graphs (every shape, decode's and verify's), cached apart from eager tables."""
    engine = engines("mixtral", True)
    graphs = Counting(capture_after=5)  # measure_step_times captures every shape it times at once
    table = step_times.measure_step_times(engine.model, engine.executor, engine.config, engine.device, engine.dtype,
                                      [1, 2], 3, prompt=8, repeat=2, graphs=graphs)
    assert sorted(table) == [f"{b},{k}" for b in (1, 2) for k in (1, 2, 3)] and min(table.values()) > 0
    assert sorted({(b, t) for b, t, _ in graphs.calls}) == [(b, k) for b in (1, 2) for k in (1, 2, 3)]
    assert all(went for _, _, went in graphs.calls)
    assert all(not g.captured for g in graphs.made)  # released once timed

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    timed = []
    monkeypatch.setattr(step_times, "measure_step_times", lambda *a, graphs=None, **k: timed.append(graphs) or {"1,1": 1.0})
    step_times.engine_step_times(engine, 1, 1)
    monkeypatch.setattr(engine.runner, "graphs", GraphedDecode(engine.model, engine.cache, capture=False))
    step_times.engine_step_times(engine, 1, 1)
    assert timed[0] is False and callable(timed[1])
    assert len(list((tmp_path / "cache").glob("speculative-steps-*.json"))) == 2
