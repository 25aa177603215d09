"""`moedesk bench --context N`: decode and a prefill piece after N tokens of context, the budget counting the cache."""
import torch

from moedesk.app.cli import main
from moedesk.bench.budget import budget_for_experts
from moedesk.bench.depth import depth_context, measure_at_depth
from moedesk.bench.synthetic import random_prompt, run_bench
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.expert_executor import LocalExecutor
from moedesk.engine.offload.gpu_budget import kv_bytes_per_position


def test_bench_measures_each_depth_beside_depth_zero_and_counts_the_cache_in_the_budget():
    cfg = shape_config("tiny-moe", 2)
    deepest = depth_context(300, 6, 32)
    budget = budget_for_experts(cfg, 5, deepest)  # room for 5 of the 16 experts beside the rest at the deepest
    report = run_bench("tiny-moe", 2, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=1,
                       log=lambda *a: None, contexts=(40, 300), context_chunk=32)
    rows = [(r["mode"], r["depth"], r["tokens"]) for r in report["results"]]
    assert rows == [("decode", 0, 6), ("prefill", 0, 16), ("decode", 40, 6), ("prefill", 40, 32),
                    ("decode", 300, 6), ("prefill", 300, 32)]
    assert all(r["tok_s"] > 0 for r in report["results"])
    split = report["budget_split_bytes"]
    assert split["kv_cache"] > 0 and split["weights"] > 0
    assert sum(split.values()) == int(budget * 2**30)  # every part of the budget, once
    assert report["experts_on_gpu"] == 5  # what the weights, cache and workspace left, not the whole budget
    assert split["kv_cache"] == deepest * kv_bytes_per_position(cfg, 4)  # the deepest run's cache, in float32


def test_the_context_is_prefilled_in_pieces_into_the_cache_decode_reads(monkeypatch):
    """The runs at a depth see the whole context: the cache after the piecewise fill holds what one forward over
    the same tokens writes, at every position (so decode attends over `depth` real entries)."""
    cfg = shape_config("tiny-moe", 2)
    model, banks = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=256)
    executor = LocalExecutor()
    caches = []
    from moedesk.engine.generation import runner as runner_module

    made = runner_module.ModelRunner.reserve

    def keep(self, rows, length):
        made(self, rows, length)
        if self.cache not in caches:
            caches.append(self.cache)

    monkeypatch.setattr(runner_module.ModelRunner, "reserve", keep)
    prompt = random_prompt(100 + 16, cfg.vocab_size, 0)
    times = measure_at_depth(model, executor, "cpu", torch.float32, prompt, 100, decode_tokens=4, chunk=16,
                             graphs=False, piece=24)
    assert times.depth == 100 and times.chunk == 16 and times.decode_steps == 2 and times.decode_s > 0
    tokens = torch.tensor([prompt[:100]])
    whole = model.new_cache(1, 100, torch.float32, "cpu")
    model(tokens, torch.arange(100)[None], whole, executor)
    [cache] = caches
    for mine, theirs in zip(cache.k, whole.k):
        torch.testing.assert_close(mine[:, :100], theirs[:, :100], rtol=1e-4, atol=1e-5)


def test_context_is_refused_in_one_line_where_it_does_not_apply(capsys):
    assert main(["bench", "--shape", "tiny-moe", "--device", "cpu", "--context", "64", "--speculative"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--context" in line and "llama-bench -d" in line


def test_around_decode_wraps_the_timed_decode_steps_alone(monkeypatch):
    """tests/perf/profile_depth.py profiles decode at depth through this hook: neither the context's prefill nor the
    first (graph-capturing) step may fall inside it."""
    from contextlib import contextmanager

    from moedesk.engine.generation.decoder import Decoder

    cfg = shape_config("tiny-moe", 2)
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=256)
    inside, calls = [False], []
    for name in ("decode", "prefill"):
        real = getattr(Decoder, name)
        monkeypatch.setattr(Decoder, name, lambda self, *a, _real=real, _name=name, **k:
                            calls.append((_name, inside[0])) or _real(self, *a, **k))

    @contextmanager
    def around():
        inside[0] = True
        yield
        inside[0] = False

    measure_at_depth(model, LocalExecutor(), "cpu", torch.float32, random_prompt(116, cfg.vocab_size, 0), 100,
                     decode_tokens=6, chunk=16, graphs=False, piece=48, around_decode=around())
    assert [c for c in calls if c[1]] == [("decode", True)] * 4
    assert ("decode", False) in calls and all(not inside for name, inside in calls if name == "prefill")
