"""What the bench's decode steps feed: random tokens as llama-bench does (the default), or the model's own choice.

A random-weight model decoding greedily falls into a trajectory of its own, and which experts that trajectory touches
set the speed the bench reported (docs/benchmarks.md, "What decode feeds"); fed random tokens make the routing a run
sees independent of the model's argmax."""
import pytest
import torch

from moedesk.app.cli import main
from moedesk.bench.depth import measure_at_depth
from moedesk.bench.feed import experts_touched, fed_tokens, selection_counts
from moedesk.bench.synthetic import measure_decode, random_prompt, run_bench
from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation import runner as runner_module
from moedesk.engine.generation.decoder import Decoder
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.expert_executor import LocalExecutor
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative.verification import check_request

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    cfg = shape_config("tiny-moe", 4)  # 4 MoE layers of 8 experts, top 2
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=256)
    return cfg, model


def repeating(model):
    """The same model with an lm_head of zeros: every logit 0, so greedy decoding repeats token 0 forever."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.zero_()
    return other


def fed_steps(monkeypatch) -> list[list[int]]:
    """Records the tokens each decode step's forward (ModelRunner.step) is given, one list per step."""
    steps = []
    real = runner_module.ModelRunner.step
    monkeypatch.setattr(runner_module.ModelRunner, "step",
                        lambda self, tokens, *a, **k: steps.append(tokens[:, -1].tolist()) or real(self, tokens, *a, **k))
    return steps


def test_random_feed_is_seeded_uniform_over_the_vocabulary_and_greedy_feeds_nothing():
    a, b = fed_tokens("random", 4000, 512, 7), fed_tokens("random", 4000, 512, 7)
    assert a == b and fed_tokens("random", 4000, 512, 8) != a
    assert min(a) == 0 and max(a) == 511  # the whole vocabulary, as llama-bench's rand() % n_vocab
    assert 0.9 < sum(t < 256 for t in a) / 2000 < 1.1  # half of them in each half of it
    assert fed_tokens("random", 5, 512, 7) == a[:5]
    assert fed_tokens("greedy", 5, 512, 7) == ()
    with pytest.raises(ValueError, match="random, greedy"):
        fed_tokens("sampled", 5, 512, 7)


def test_the_decoder_feeds_a_requests_fed_tokens_to_its_next_steps_then_decodes_its_own(tiny):
    """The reply is the fed tokens, then the model's greedy choice after prompt + fed tokens: the next forward read
    the fed token, not the one the model chose. The reference is one eager forward over the whole sequence."""
    cfg, model = tiny
    prompt, fed = random_prompt(12, cfg.vocab_size, 0), (5, 400, 5, 77)
    runner = ModelRunner(model, CPU, torch.float32, 64)
    runner.reserve(1, 64)
    [(seq, _)] = [(s, t) for s, t in Decoder(runner, LocalExecutor(), None).run(
        [Request(prompt, GREEDY, fed_tokens=fed)], batch_size=1) if s.finish_reason]
    assert tuple(seq.tokens[:4]) == fed
    ids = prompt + list(fed)
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, LocalExecutor())
    assert seq.tokens[4] == int(logits[0, -1].argmax())


def test_fed_tokens_go_with_plain_decoding_alone(tiny):
    class Grammar:
        def matcher(self):
            return None

    runner = ModelRunner(tiny[1], CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="fed tokens or a grammar"):
        Decoder(runner, LocalExecutor(), None).start(Request([1, 2], GREEDY, grammar=Grammar(), fed_tokens=(3,)), 0)
    with pytest.raises(MoedeskError, match="fed tokens"):
        check_request(Request([1, 2], GREEDY, fed_tokens=(3,)), 64)


def test_random_runs_of_one_seed_feed_the_same_tokens_and_greedy_its_own(tiny, monkeypatch):
    cfg, model = tiny
    steps = fed_steps(monkeypatch)
    runs = {}
    for name, feed in (("random", "random"), ("again", "random"), ("greedy", "greedy")):
        steps.clear()
        r = measure_decode(model, LocalExecutor(), cfg, CPU, torch.float32, 2, new_tokens=8, prompt=8, seed=3,
                           graphs=False, feed=feed)
        assert r.feed == feed
        runs[name] = [list(row) for row in steps]
    assert runs["random"] == runs["again"] != runs["greedy"]
    # Step j feeds each sequence's token j of its feed (the prefill's choice was token 0).
    want = [fed_tokens("random", 8, cfg.vocab_size, 3 + i) for i in range(2)]
    assert runs["random"] == [[want[0][j], want[1][j]] for j in range(7)]


def test_random_fed_routing_does_not_depend_on_the_models_argmax(tiny):
    """A model that repeats one token under greedy decoding touches few experts; fed random tokens, it routes
    exactly as the same model with another lm_head does (the lm_head only decides the tokens it would choose)."""
    cfg, model = tiny
    stuck = repeating(model)
    touched, counts = {}, {}
    for name, m in (("model", model), ("stuck", stuck)):
        for feed in ("random", "greedy"):
            executor = LocalExecutor()
            r = measure_decode(m, executor, cfg, CPU, torch.float32, 1, new_tokens=24, prompt=16, graphs=False,
                               feed=feed)
            touched[name, feed], counts[name, feed] = r.experts_touched, executor.selections
    for layer in counts["model", "random"]:
        assert torch.equal(counts["model", "random"][layer], counts["stuck", "random"][layer])
    assert touched["model", "random"] == touched["stuck", "random"] >= 20  # of the 32 (layer, expert) pairs
    assert touched["stuck", "greedy"] < touched["stuck", "random"] / 2


def test_experts_touched_counts_pairs_selected_since_the_snapshot():
    class Counts:
        selections = {0: torch.tensor([3, 0, 1]), 1: torch.tensor([0, 0, 2])}

    executor = Counts()
    before = selection_counts(executor)
    executor.selections = {0: torch.tensor([3, 2, 4]), 1: torch.tensor([0, 0, 2]), 2: torch.tensor([1, 0, 0])}
    assert experts_touched(executor, before) == 3  # (0, 1), (0, 2) and the new layer's (2, 0)
    assert experts_touched(object(), before) is None


@pytest.mark.parametrize("feed", ["random", "greedy"])
def test_timed_steps_replay_the_graphs_whatever_is_fed(tiny, feed, monkeypatch):
    """Every decode step after the first, which captures, goes through the graphs' replay (here their segments
    run eagerly: capture=False, the CPU's stand-in for capture and replay), fed random tokens as greedy ones."""
    from moedesk.engine.generation import cuda_graphs

    cfg, model = tiny
    made, replays = [], []
    real = cuda_graphs._Captured.replay
    monkeypatch.setattr(cuda_graphs._Captured, "replay", lambda self, *a, **k: replays.append(1) or real(self, *a, **k))

    def segments(m, cache):
        made.append(cuda_graphs.GraphedDecode(m, cache, capture=False))
        return made[-1]

    r = measure_decode(model, LocalExecutor(), cfg, CPU, torch.float32, 2, new_tokens=8, prompt=8, graphs=segments,
                       feed=feed)
    [graphs] = made
    assert graphs.captures == 1 and graphs.broken is None
    assert len(replays) == 8 - 2  # the 7 decode steps less the one that captured: every timed step
    assert r.feed == feed and r.tokens == 8


def test_decode_at_depth_feeds_random_tokens_by_default(tiny, monkeypatch):
    cfg, model = tiny
    steps = fed_steps(monkeypatch)
    prompt = random_prompt(100 + 16, cfg.vocab_size, 0)
    t = measure_at_depth(model, LocalExecutor(), "cpu", torch.float32, prompt, 100, decode_tokens=6, chunk=16,
                         graphs=False, piece=50, seed=4)
    assert t.feed == "random" and t.experts_touched > 0
    want = fed_tokens("random", 8, cfg.vocab_size, 4)
    assert [row[0] for row in steps] == list(want[:len(steps)]) and len(steps) == 5  # the capture's, then 4 timed
    steps.clear()
    measure_at_depth(model, LocalExecutor(), "cpu", torch.float32, prompt, 100, decode_tokens=6, chunk=16,
                     graphs=False, piece=50, feed="greedy")
    assert [row[0] for row in steps] != list(want[:5])


@pytest.mark.parametrize("feed", ["random", "greedy"])
def test_bench_calibrates_and_measures_with_its_feed_and_reports_it(feed, monkeypatch):
    """The calibration decodes feed what the measured runs feed: placement learns the routing they will see."""
    from moedesk.bench import synthetic

    fed = []
    real = synthetic.measure_decode
    monkeypatch.setattr(synthetic, "measure_decode", lambda *a, **k: fed.append(k["feed"]) or real(*a, **k))
    report = run_bench("tiny-moe", 2, 0, device="cpu", decode_tokens=6, prefill=(), batch=2, log=lambda *a: None,
                       contexts=(40,), context_chunk=16, feed=feed)
    assert fed == [feed] * 4  # the two calibration halves, then one sequence and the batch
    assert report["feed"] == feed
    decodes = [r for r in report["results"] if r["mode"] != "prefill"]
    assert len(decodes) == 3 and all(r["feed"] == feed and r["experts_touched"] > 0 for r in decodes)
    said = {"random": "decode steps feed random tokens, as llama-bench", "greedy": "the model's own greedy choice"}
    assert said[feed] in synthetic.format_results(report)


def test_the_cli_feeds_random_tokens_unless_told_and_refuses_feed_where_runs_decode_their_own(capsys, monkeypatch):
    from moedesk.bench import synthetic

    asked = []

    def stop(*a, feed=None, **k):
        asked.append(feed)
        raise MoedeskError("stopped before building")

    monkeypatch.setattr(synthetic, "run_bench", stop)
    monkeypatch.setattr(synthetic, "prepare_synthetic", stop)
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu"]) == 2
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--feed", "greedy"]) == 2
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--beams", "4"]) == 2  # calibrated greedy
    assert asked == ["random", "greedy", "greedy"]
    capsys.readouterr()
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--feed", "greedy", "--beams", "4"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--feed" in line and len(asked) == 3
