"""Speculative verify forwards replayed from captured CUDA graphs, on the GPU box, every expert in RAM.

Captured graphs of k tokens per row (chains; trees with their mask and slots as inputs) give the eager
forward's logits and features, at the capture and at a later replay of other tokens; speculative decoding
with graphs (chains, trees, and auto rounds that draft nothing, which replay the plain step's shape) gives
plain greedy's tokens. float32 tiny models, so a few seconds each.

    python -m pytest -m gpu tests/speculative/test_speculative_graphs_gpu.py
"""
import pytest
import torch

from moedesk.engine.generation.cuda_graphs import GraphedDecode
from moedesk.engine.requests import Request
from moedesk.engine.speculative import auto, eagle_drafter, step_times
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from moedesk.engine.speculative.verification import Speculator
from tests.speculative.test_speculative_decode import PROMPTS, greedy, plain, random_head
from tests.speculative.test_speculative_graphs import verify_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines(engines):
    """tests/conftest.py's engines, on the GPU with every expert in RAM unless device is "cpu"."""
    return lambda arch, device="cuda": engines(arch, offload=device == "cuda", device=device)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_captured_verify_graphs_equal_the_eager_forward(arch, engines):
    engine = engines(arch)
    features = ("final", 1)
    for shape in ("chain", "tree"):
        for rows in (False, True):
            cache, twin, (tokens, positions, where, mask, slots) = verify_inputs(engine, shape, rows)
            graphs = GraphedDecode(engine.model, twin, capture_after=1)
            for seed in (0, 1):  # the capturing call, then a replay of other tokens at the same places
                if seed:
                    g = torch.Generator().manual_seed(seed)
                    tokens = torch.randint(3, engine.vocab_size, tokens.shape, generator=g).to(engine.device)
                want, want_hidden = engine.model(tokens, positions, cache, engine.executor, rows=where, mask=mask,
                                                 slots=slots, features=features)
                out = graphs.forward(tokens, positions, engine.executor, where, mask=mask, slots=slots,
                                     features=features)
                assert graphs.broken is None, (shape, rows, graphs.broken)
                got, hidden = out
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{shape} {rows}: {m}")
                for key in features:
                    torch.testing.assert_close(hidden[key], want_hidden[key], rtol=1e-4, atol=1e-4)
            (captured,) = graphs.captured.values()
            assert captured.graphs, (shape, rows)  # replayed from graphs, not the eager segments
            torch.testing.assert_close(twin.k[0], cache.k[0], rtol=1e-4, atol=1e-4)


def _table(batch, max_k, cost):
    return {(b, k): cost(b, k) for b in range(1, batch + 1) for k in range(1, max_k + 1)}


def _run(engine, requests, factory, **kw):
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer)
    done, stats = sp.run(requests, engine.executor, factory, **kw)
    assert sp.runner.graphs is not None and sp.runner.graphs.broken is None, sp.runner.graphs and sp.runner.graphs.broken
    shapes = [key[:2] for key, c in sp.runner.graphs.captured.items() if c.graphs]
    return [c.token_ids for c in done], stats, shapes


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_speculative_greedy_with_graphs_equals_plain_greedy(arch, engines):
    engine = engines(arch)
    assert engine.graphs is not None  # plain decode replays graphs too
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=n), tag=i)
                for i, (p, n) in enumerate(zip(PROMPTS, (24, 16, 10)))]
    expected = plain(engine, requests)
    factory = oracle_factory(expected, 0.3, engine.vocab_size, seed=1)
    for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
        tokens, _, shapes = _run(engine, requests, factory, mode=mode, draft_length=3, draft_width=width,
                                 budget=budget)
        assert tokens == expected, mode
        assert any(k > 1 for _, k in shapes), (mode, shapes)  # verify forwards were captured and replayed
    costs = auto.RunningCosts(_table(3, 5, lambda b, k: 10.0 * k))  # auto: drafting never pays
    tokens, stats, shapes = _run(engine, requests, factory, mode="auto", draft_length=3, costs=costs)
    assert tokens == expected and {r[0] for r in stats.rounds} == {0}
    assert shapes and all(k == 1 for _, k in shapes), shapes


def test_eagle_features_from_graphs_keep_greedy_output(engines, tmp_path):
    """An EAGLE head drafting from the features the captured graphs return (chains and trees)."""
    engine = engines("mixtral")
    random_head(engines("mixtral", "cpu"), 1, tmp_path / "head")  # written from CPU tensors, loaded onto the GPU
    head = eagle_drafter.draft_head(engine, tmp_path / "head")
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=n)) for p, n in zip(PROMPTS, (20, 12, 8))]
    expected = plain(engine, requests)
    factory = eagle_drafter.eagle_factory(head, engine.config.num_layers)
    for mode, width, budget in (("greedy", 1, None), ("beam", 2, 5)):
        tokens, _, shapes = _run(engine, requests, factory, mode=mode, draft_length=3, draft_width=width,
                                 budget=budget)
        assert tokens == expected, mode
        assert any(k > 1 for _, k in shapes), (mode, shapes)


def test_auto_step_times_replay_captured_graphs(engines):
    """measure_step_times on CUDA times every (B, k) from captured graphs (the table auto prices rounds with);
    both tables are printed for comparison (-s)."""
    engine = engines("mixtral")
    went = []

    def factory(model, cache):
        graphs = GraphedDecode(model, cache)
        forward = graphs.forward

        def counted(*a, **k):
            out = forward(*a, **k)
            went.append(out is not None and all(c.graphs for c in graphs.captured.values()))
            return out

        graphs.forward = counted
        return graphs

    args = (engine.model, engine.executor, engine.config, engine.device, engine.dtype, [1, 4], 3)
    graphed = step_times.measure_step_times(*args, prompt=16, repeat=2, graphs=factory)
    eager = step_times.measure_step_times(*args, prompt=16, repeat=2, graphs=False)
    print({k: (round(graphed[k], 2), round(eager[k], 2)) for k in graphed})
    assert sorted(graphed) == sorted(eager) == [f"{b},{k}" for b in (1, 4) for k in (1, 2, 3)]
    assert went and all(went)
