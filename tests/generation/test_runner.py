"""ModelRunner's bookkeeping with a fake model and fake graphs: where a forward goes, the out-of-memory retry,
and what reserve, shrink and release do to the cache and graphs it owns."""
import pytest
import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.runner import ModelRunner


class FakeCache:
    def __init__(self, rows, length):
        self.rows, self.length, self.shrunk, self.forks, self.accepted = rows, length, [], [], []

    def ensure(self, rows, length):
        self.rows, self.length = max(self.rows, rows), max(self.length, length)

    def shrink(self, rows, length):
        self.shrunk.append((rows, length))
        self.rows, self.length = rows, length

    def reorder(self, block, source, length):
        self.forks.append((block, source, length))

    def accept(self, rows, starts, paths):
        self.accepted.append((rows, starts, paths))


class FakeModel:
    def __init__(self, fail=0):
        self.calls, self.fail = [], fail

    def new_cache(self, rows, length, dtype, device):
        return FakeCache(rows, length)

    def __call__(self, tokens, positions, cache, executor, **kwargs):
        if self.fail:
            self.fail -= 1
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.calls.append(kwargs)
        return "eager"


class FakeGraphs:
    def __init__(self, model, cache, answer=None):
        self.model, self.cache, self.answer = model, cache, answer
        self.forwards, self.released, self.captures, self.warmups = 0, 0, 2, 1

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return self.answer

    def release(self):
        self.released += 1


def test_steps_replay_graphs_and_fall_back_to_the_eager_forward_prefills_are_eager():
    model = FakeModel()
    runner = ModelRunner(model, "cpu", torch.float32, 64, graphs=FakeGraphs)
    runner.reserve(2, 16)
    graphs = runner.graphs
    assert graphs.cache is runner.cache and runner.cache.rows == 2
    assert runner.step(None, None, "executor") == "eager" and graphs.forwards == 1  # not captured: eager
    graphs.answer = "replayed"
    assert runner.step(None, None, "executor") == "replayed" and len(model.calls) == 1
    assert runner.prefill(None, None, "executor", logits_at="last") == "eager" and graphs.forwards == 2
    assert model.calls[-1]["logits_at"] == "last"
    assert runner.graph_captures() == 3
    runner.reserve(4, 8)  # grows the same cache: the graphs notice the move themselves
    assert runner.graphs is graphs and (runner.cache.rows, runner.cache.length) == (4, 16)


def test_eager_without_graphs_and_row_operations_go_to_the_cache():
    runner = ModelRunner(FakeModel(), "cpu", torch.float32, 64, stop_ids=[2, 3])
    runner.reserve(1, 8)
    assert runner.graphs is None and runner.graph_captures() == 0 and runner.stop_ids == frozenset({2, 3})
    assert runner.step(None, None, None) == "eager"
    runner.fork([4, 5], [1, 1], 7)
    runner.accept([0], [3], [[2]])
    assert runner.cache.forks == [([4, 5], [1, 1], 7)] and runner.cache.accepted == [([0], [3], [[2]])]


def test_shrink_releases_the_graphs_before_the_cache():
    runner = ModelRunner(FakeModel(), "cpu", torch.float32, 64, graphs=FakeGraphs)
    runner.reserve(8, 32)
    runner.shrink(1, 4)
    assert runner.graphs.released == 1 and runner.cache.shrunk == [(1, 4)]


def test_out_of_memory_is_retried_while_memory_is_freed_then_one_line_with_the_advice():
    freed = []
    model = FakeModel(fail=2)
    runner = ModelRunner(model, "cpu", torch.float32, 64, on_oom=lambda: freed.append(1) or True)
    runner.reserve(1, 8)
    assert runner.step(None, None, None) == "eager" and len(freed) == 2
    model.fail = 1
    stuck = ModelRunner(model, "cpu", torch.float32, 64, on_oom=lambda: False, advice="use fewer beams")
    stuck.reserve(1, 8)
    with pytest.raises(MoedeskError, match="nothing left to move to RAM: use fewer beams$"):
        stuck.prefill(None, None, None)


class StatefulCache(FakeCache):
    """A cache whose forwards change what they read (a recurrent state): what was saved, what put back."""
    stateful = True

    def __init__(self, rows, length):
        super().__init__(rows, length)
        self.saves, self.restores = [], 0

    def save(self, rows, batch):
        self.saves.append((rows, batch))
        return len(self.saves)

    def restore(self, saved):
        assert saved == len(self.saves)
        self.restores += 1


class StatefulModel(FakeModel):
    def new_cache(self, rows, length, dtype, device):
        return StatefulCache(rows, length)


def test_a_stateful_cache_saves_the_touched_rows_once_and_puts_them_back_before_each_retry():
    model = StatefulModel(fail=2)
    runner = ModelRunner(model, "cpu", torch.float32, 64, on_oom=lambda: True)
    runner.reserve(4, 8)
    rows = torch.tensor([3, 1])
    assert runner.step(torch.zeros(2, 1, dtype=torch.long), None, None, rows) == "eager"
    assert runner.cache.saves == [(rows, 2)] and runner.cache.restores == 2
    assert runner.prefill(torch.zeros(3, 5, dtype=torch.long), None, None) == "eager"
    assert runner.cache.saves[-1] == (None, 3) and runner.cache.restores == 2  # no failure: nothing put back
    model.fail = 1
    runner.on_oom = lambda: False  # the error, with the states as they were
    with pytest.raises(MoedeskError):
        runner.step(torch.zeros(1, 1, dtype=torch.long), None, None)
    assert runner.cache.restores == 3
    lone = ModelRunner(StatefulModel(), "cpu", torch.float32, 64)  # no retry: no copy
    lone.reserve(1, 8)
    lone.step(torch.zeros(1, 1, dtype=torch.long), None, None)
    assert lone.cache.saves == []


def test_a_cpu_model_with_native_matrices_shares_the_cores_by_the_forward_s_tokens(monkeypatch):
    """A CPU model holding packed weights (computed by the native kernels' pool): forwards of few tokens (a step, a
    short prompt) over a short context run torch on one thread; longer ones, and a step deep in a long context whose
    attention torch computes, keep torch's threads and let the pool's workers sleep between calls; both put the
    settings back. Where the pool computes a step's attention too, a deep step stays on one thread. A model without
    packed weights never changes them."""
    from moedesk.engine.generation import runner as runner_module
    from moedesk.engine.model.packed_linear import PackedLinear
    from moedesk.kernels import cpu_experts, cpu_quant
    from moedesk.kernels.quant_formats import quantize

    spins = []
    monkeypatch.setattr(cpu_experts, "set_spin_us", spins.append)

    class PoolAttention(torch.nn.Module):
        native_decode = True

    class Counting(torch.nn.Module):
        def __init__(self, packed: bool, pool: bool):
            super().__init__()
            self.head = PackedLinear(quantize(torch.randn(4, 32), "q8_0"), "q8_0", 32) if packed else None
            self.attn = PoolAttention() if pool else None
            self.seen = []

        def new_cache(self, rows, length, dtype, device):
            return FakeCache(rows, length)

        def forward(self, tokens, positions, cache, executor, **kwargs):
            self.seen.append((torch.get_num_threads(), len(spins)))
            return "eager"

    long = runner_module.SHORT_FORWARD + 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for packed, pool in ((True, False), (True, True), (False, False)):
            spins.clear()
            model = Counting(packed, pool)
            runner = ModelRunner(model, "cpu", torch.float32, 16)
            runner.reserve(1, 8)
            runner.prefill(torch.zeros(1, 3), torch.zeros(1, 3), None)
            runner.prefill(torch.zeros(1, long), torch.zeros(1, long), None)
            runner.step(torch.zeros(4, 1), torch.zeros(4, 1), None)
            # two rows whose contexts average the crossing: one deep, one short
            deep = torch.tensor([[2 * runner_module.LONG_CONTEXT - 2], [0]])
            runner.step(torch.zeros(2, 1), deep, None)
            runner.step(torch.zeros(2, 1), deep - 2, None)
            runner.step(torch.zeros(2, 2), torch.cat([deep, deep + 1], 1), None)  # a verify's chain: torch's attention
            native = packed and cpu_quant.available()
            assert runner.native_cpu is native and runner.pool_decode is (native and pool)
            if native and pool:  # every thread only for the long prompt and the deep chain
                assert model.seen == [(1, 0), (2, 1), (1, 2), (1, 2), (1, 2), (2, 3)]
                assert spins == [0, cpu_experts.DEFAULT_SPIN_US] * 2
            elif native:  # one thread, every thread with the pool told not to spin, one thread, every, one, every
                assert model.seen == [(1, 0), (2, 1), (1, 2), (2, 3), (1, 4), (2, 5)]
                assert spins == [0, cpu_experts.DEFAULT_SPIN_US] * 3
            else:
                assert model.seen == [(2, 0)] * 6 and spins == []
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
