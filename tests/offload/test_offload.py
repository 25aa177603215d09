"""The offload executor gives the same tokens at every GPU budget and every CPU/copy split.

Without a GPU the "GPU" tier is simulated on the CPU, so placement, decisions, staging copies
and the ordered sum run for real.
"""
from types import SimpleNamespace

import pytest

from moedesk.engine.offload.offload_executor import OffloadExecutor, stack_experts
from moedesk.engine.offload.assignment import Costs, assign_offloaded
from moedesk.engine.offload.placement import plan_placement
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b"]
POLICIES = {
    "all-cpu": lambda loads: (sorted(loads), []),
    "all-copy": lambda loads: ([], sorted(loads)),
    "balanced": lambda loads: assign_offloaded(loads, Costs(lambda n: 1 + n, lambda n: 0.2, 1.5)),
}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_every_budget_and_policy_generates_the_reference_tokens(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(folder), p, 16, eos) for p in prompts]
    list(engine.generate([Request(p, params) for p in prompts]))  # popularity from a first run
    popularity = [engine.executor.selections[layer].tolist() for layer in sorted(engine.executor.selections)]
    banks = stack_experts(engine.model, pinned=False)
    expert_bytes = banks[next(iter(banks))].expert_bytes
    total = sum(map(len, popularity))
    for fits in (0, 1, total // 2, total):
        on_gpu = plan_placement(expert_bytes, len(popularity), len(popularity[0]), popularity,
                                fits * expert_bytes, 0).as_lists()
        assert sum(map(sum, on_gpu)) == fits
        for (name, decide), overlap in zip(POLICIES.items(), (False, False, True)):
            # balanced's steps run the CPU's call beside the queueing of the copies (overlap_copies)
            engine.executor = OffloadExecutor(banks, on_gpu, "cpu", decide, overlap_copies=overlap)
            done = {c.tag: c.token_ids for c in engine.generate(
                [Request(p, params, tag=i) for i, p in enumerate(prompts)], batch_size=2)}
            assert [done[i] for i in range(len(prompts))] == expected, (fits, name)
            stats = engine.executor.stats
            assert stats.gpu_experts + stats.cpu_experts + stats.copied_experts > 0
            if fits == total:
                assert stats.cpu_experts == stats.copied_experts == 0 and stats.gpu_hits == stats.selections
            if fits == 0:
                assert stats.gpu_experts == 0
                assert (stats.cpu_experts == 0) == (name == "all-copy")
                if name == "balanced":  # steps that computed beside their copies' queueing
                    assert stats.cpu_experts and stats.copied_experts


def test_resident_experts_moved_to_the_cpu_keep_the_reference_tokens(tiny_checkpoint):
    """When the executor has the CPU compute resident experts from their host copies, the tokens stay
    transformers' and the stats say where the work ran."""
    folder = tiny_checkpoint("mixtral")
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(folder), p, 12, eos) for p in prompts]
    banks = stack_experts(engine.model, pinned=False)
    half = [[e % 2 == 0 for e in range(bank.num_experts)] for bank in banks.values()]
    asked = []

    def take_all(loads):
        asked.append(dict(loads))
        return sorted(loads)

    stats = {}
    for name, hook in (("gpu", None), ("moved", take_all)):
        engine.executor = OffloadExecutor(banks, half, "cpu", POLICIES["all-cpu"], resident_to_cpu=hook)
        done = {c.tag: c.token_ids for c in engine.generate(
            [Request(p, params, tag=i) for i, p in enumerate(prompts)], batch_size=2)}
        assert [done[i] for i in range(len(prompts))] == expected, name
        stats[name] = engine.executor.stats
    # Asked only about resident (even) experts, in steps with CPU work; each one it took moved from GPU to CPU.
    moved = sum(len(loads) for loads in asked)
    assert moved > 0 and all(e % 2 == 0 for loads in asked for e in loads)
    assert stats["moved"].cpu_experts == stats["gpu"].cpu_experts + moved
    assert stats["moved"].gpu_experts == stats["gpu"].gpu_experts - moved
    assert stats["moved"].gpu_hits < stats["gpu"].gpu_hits


def test_bench_runs_on_the_simulated_tier():
    from moedesk.bench.budget import budget_for_experts
    from moedesk.bench.synthetic import bench_context, run_bench
    from moedesk.engine.load.synthetic import shape_config

    budget = budget_for_experts(shape_config("tiny-moe", 2), 2, bench_context((16,), 6), "dense", "cpu")
    report = run_bench("tiny-moe", 2, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=2, log=lambda *a: None)
    modes = [r["mode"] for r in report["results"]]
    assert modes == ["decode", "prefill", "batched_decode"]
    assert all(r["tok_s"] > 0 and r["bound_tok_s"] > 0 for r in report["results"])
    assert 0 < report["experts_on_gpu"] < 16
    assert 0 <= report["popularity_evenness"] <= 1 and report["whole_layers_on_gpu"] in (0, 1)
    # The prefill's bound is per run: its counts cover every round it is the best of.
    prefill = report["results"][1]
    e, rounds = prefill["experts"], prefill["rounds"]
    assert rounds > 2 and e["experts_cpu"] + e["experts_copied"] > 0
    read = (e["experts_cpu"] + e["experts_copied"] + e["experts_zero_copy"]) / rounds * report["profile"]["expert_bytes"]
    assert prefill["bound_tok_s"] == pytest.approx(16 * report["profile"]["h2d_gbs"] * 1e9 / read)


def test_traffic_bound_counts_the_offloaded_experts_each_step_read():
    from moedesk.bench.synthetic import traffic_bound
    from moedesk.engine.offload.offload_executor import StepStats

    # 10 steps that computed 30 experts on the CPU and copied 10: 4 expert reads per step.
    stats = StepStats(gpu_experts=50, cpu_experts=30, copied_experts=10)
    assert traffic_bound(stats, 10, 1, expert_bytes=2e9, bytes_per_s=100e9) == pytest.approx(12.5)
    assert traffic_bound(stats, 10, 16, expert_bytes=2e9, bytes_per_s=100e9) == pytest.approx(200)
    assert traffic_bound(StepStats(gpu_experts=8), 4, 1, 2e9, 100e9) is None  # nothing offloaded: no bound
    # Experts the GPU read zero-copy from RAM were read from it as well.
    assert traffic_bound(StepStats(cpu_experts=30, zero_copy_experts=10), 10, 1, 2e9, 100e9) == pytest.approx(12.5)


def test_step_stats_name_each_place_an_expert_ran():
    """The keys a reply's expert stats publish (the app's panel, /moedesk/stats, batch output), one per place,
    in docs/architecture.md's names: experts the GPU read from pinned RAM are zero-copy, not "streamed"."""
    from moedesk.engine.offload.offload_executor import StepStats

    stats = StepStats(gpu_experts=5, copied_experts=1, cpu_experts=3, zero_copy_experts=2, split_experts=1).as_dict()
    places = ("experts_gpu", "experts_copied", "experts_cpu", "experts_zero_copy", "experts_split")
    assert [stats[key] for key in places] == [5, 1, 3, 2, 1]
    assert stats["active_experts"] == 11  # a split expert is one of the CPU's, counted once
    assert not [key for key in stats if "streamed" in key]

def test_zero_copy_ranks_are_left_to_the_gpu():
    """With `HostRouting.zero_copy` set, the host computes only the token's other experts and leaves the
    zero-copy ranks' rows of `out` as the GPU wrote them (on CUDA, engine.generation.cuda_graphs launches the GPU's share)."""
    import torch

    from moedesk.engine.offload.expert_executor import HostRouting
    from moedesk.kernels.cpu_experts import expert_forward
    from moedesk.kernels.expert_weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(6, 16, 12, generator=g), torch.randn(6, 12, 8, generator=g)
    bank = ExpertWeights(gate_up, down, hidden=12, width=8)
    executor = OffloadExecutor({0: bank}, [[False] * 6], "cpu", lambda loads: (sorted(loads), []))
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.randn(1, 12, generator=g), torch.tensor([[0, 2, 3, 5]])
    out = torch.full((4, 12), 7.0)
    executor.expert_outputs(moe, x, ids, out=out, host=HostRouting(x, ids, None, zero_copy=2))
    for rank in (0, 1):
        torch.testing.assert_close(out[rank:rank + 1], expert_forward(x, gate_up[ids[0, rank]], down[ids[0, rank]]))
    assert (out[2:] == 7.0).all()
    stats = executor.stats
    assert (stats.cpu_experts, stats.zero_copy_experts, stats.selections) == (2, 2, 4)
    assert executor.selections[0].tolist() == [1, 0, 1, 1, 0, 1]  # streamed experts count for popularity too
    assert executor.zero_copy_share(0, 1, 4) == 0  # the simulated tier never streams


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_bf16_cpu_tier_runs_the_native_kernel_and_keeps_greedy_tokens(arch, tiny_checkpoint, monkeypatch):
    """In bf16 every CPU expert of a layer goes through one native kernel call; greedy tokens are those of
    the all-resident run (torch's bf16 arithmetic on the simulated GPU tier)."""
    from moedesk.kernels import cpu_experts

    if not cpu_experts.available():
        pytest.skip(f"native kernel unavailable here: {cpu_experts.unavailable_reason()}")
    calls = []  # experts per native call

    class Recording:
        def __init__(self, lib):
            self.lib = lib

        def moe_routed_experts_forward(self, *args):
            rc = self.lib.moe_routed_experts_forward(*args)
            calls.append(args[18][1])  # shape: {pairs, groups}
            return rc

        def __getattr__(self, name):
            return getattr(self.lib, name)

    monkeypatch.setitem(cpu_experts._state, "lib", Recording(cpu_experts._state["lib"]))
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="bfloat16")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    banks = stack_experts(engine.model, pinned=False)
    shape = [bank.num_experts for _, bank in sorted(banks.items())]
    runs = {}
    for name, resident in (("resident", True), ("cpu", False)):
        engine.executor = OffloadExecutor(banks, [[resident] * n for n in shape], "cpu", POLICIES["all-cpu"])
        done = {c.tag: c.token_ids for c in engine.generate(
            [Request(p, params, tag=i) for i, p in enumerate(prompts)], batch_size=2)}
        runs[name] = [done[i] for i in range(len(prompts))]
        assert (engine.executor.stats.cpu_experts > 0) == (not resident)
    assert runs["cpu"] == runs["resident"]
    assert calls and max(calls) > 1  # called, and with several experts per call


@pytest.mark.parametrize("k", [1, 2, 8])
def test_combine_rounds_as_index_add_in_expert_order(k):
    """bf16 sums are order-sensitive: MoE.combine's K adds over routing sorted by expert id must equal
    the reference's loop of one index_add_ per expert, in ascending expert order."""
    import torch

    from moedesk.engine.model.transformer import MoE

    g = torch.Generator().manual_seed(k)
    n, experts, hidden = 13, 16, 64
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])  # top-k order, unsorted
    weights = torch.rand(n, k, generator=g).to(torch.bfloat16)
    outputs = (torch.randn(n, experts, hidden, generator=g) * 100).to(torch.bfloat16)  # expert e on token t
    expected = torch.zeros(n, hidden, dtype=torch.bfloat16)
    for e in range(experts):
        token, slot = torch.where(ids == e)
        expected.index_add_(0, token, outputs[token, e] * weights[token, slot].unsqueeze(-1))
    sorted_ids, rank = ids.sort(dim=-1)  # what MoE.route returns
    y = outputs[torch.arange(n).unsqueeze(-1), sorted_ids].reshape(n * k, hidden)
    assert torch.equal(MoE.combine(y, weights.gather(-1, rank)), expected)
    if k > 2:  # the test can tell orders apart (two terms commute): summing in top-k order gives other bits
        in_topk_order = MoE.combine(outputs[torch.arange(n).unsqueeze(-1), ids].reshape(n * k, hidden), weights)
        assert not torch.equal(in_topk_order, expected)


def test_eager_steps_skip_the_host_only_for_few_tokens_an_expert(tiny_checkpoint, monkeypatch):
    """A layer with every expert resident runs from device tensors outside the graphs too, up to
    GROUPED_MAX_TOKENS tokens an expert on average; a longer prefill takes the host path, whose per-expert
    GEMMs are faster there. Both give the host path's outputs."""
    import torch

    from moedesk.engine.offload import offload_executor

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    banks = stack_experts(engine.model, pinned=False)
    layer = sorted(banks)[0]
    experts = banks[layer].num_experts
    resident = [[True] * b.num_experts for _, b in sorted(banks.items())]
    executor = OffloadExecutor(banks, resident, "cpu", POLICIES["all-cpu"])
    host_path = OffloadExecutor(banks, resident, "cpu", POLICIES["all-cpu"])
    host_path.runs_on_device = lambda layer: False  # the reference: the host's decisions for every layer
    moe = next(b.moe for b in engine.model.layers if hasattr(b, "moe") and b.moe.layer == layer)
    on_device = []
    device_outputs = executor.device_expert_outputs
    monkeypatch.setattr(executor, "device_expert_outputs",
                        lambda m, *a: on_device.append(len(a[1])) or device_outputs(m, *a))
    g = torch.Generator().manual_seed(0)
    for tokens in (3, offload_executor.GROUPED_MAX_TOKENS * experts // 2 + 1):  # 2 ranks a token
        x = torch.randn(tokens, engine.config.hidden_size, generator=g)
        ids = torch.rand(tokens, experts, generator=g).topk(2, dim=1).indices
        assert torch.allclose(executor.expert_outputs(moe, x, ids), host_path.expert_outputs(moe, x, ids), atol=1e-6)
    assert on_device == [3]  # the long prefill went through the host


def test_the_cpu_call_beside_the_copies_keeps_the_callers_modes_and_hands_back_its_error():
    import torch

    from moedesk.engine.offload.offload_executor import _Background

    seen = []
    with torch.inference_mode():
        _Background(lambda: seen.append(torch.is_inference_mode_enabled())).join()
    with torch.no_grad():
        _Background(lambda: seen.append(torch.is_grad_enabled())).join()
    assert seen == [True, False]

    def fails():
        raise ValueError("pair_expert or chosen holds an index outside the expert stack")

    with pytest.raises(ValueError, match="outside the expert stack"):
        _Background(fails).join()


def test_background_call_runs_on_one_worker_in_the_callers_modes_and_hands_back_its_error():
    """overlap_copies' CPU call: one long-lived thread (not one a step), torch's per-thread inference mode carried
    over, and an error raised where the caller joins."""
    import threading

    import torch

    from moedesk.engine.offload.offload_executor import _Background

    seen = []
    for _ in range(3):
        with torch.inference_mode():
            call = _Background(lambda: seen.append((threading.get_ident(), torch.is_inference_mode_enabled())))
        call.join()
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert all(inference for _, inference in seen)

    def fail():
        raise RuntimeError("the CPU experts' call failed")

    with pytest.raises(RuntimeError, match="call failed"):
        _Background(fail).join()


def test_a_failed_queueing_waits_for_the_cpu_call_beside_it(tiny_checkpoint, monkeypatch):
    """overlap_copies: when queueing the copies fails (a CUDA OOM the caller retries), the CPU call on the worker has
    finished before the error reaches the caller, so a retry's CPU call cannot write the same host buffer beside it."""
    import threading
    import time
    from types import SimpleNamespace

    import torch

    from moedesk.engine.offload import offload_executor as oe

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    banks = stack_experts(engine.model, pinned=False)
    layer = min(banks)
    on_gpu = [[False] * bank.num_experts for bank in banks.values()]
    half = lambda loads: (sorted(loads)[::2], sorted(loads)[1::2])  # noqa: E731
    executor = OffloadExecutor(banks, on_gpu, "cpu", half, overlap_copies=True)
    finished = threading.Event()

    def slow_call(*args, **kwargs):
        time.sleep(0.3)
        finished.set()

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(oe, "experts_forward_routed", slow_call)
    monkeypatch.setattr(executor, "_queue_gpu", oom)
    hidden = engine.config.hidden_size
    x = torch.randn(4, hidden)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    with pytest.raises(RuntimeError, match="out of memory"):
        executor.expert_outputs(SimpleNamespace(layer=layer), x, ids)
    assert finished.is_set()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_cpu_time_counts_the_cpu_call_not_the_queueing_of_the_gpu_work(tiny_checkpoint, monkeypatch, overlap):
    """StepStats.cpu_ms (the `cpu_expert_ms` users and the perf scripts read): the CPU's call, not the host's
    queueing of the GPU's share before it (a step without overlap runs them one after the other)."""
    import time
    from types import SimpleNamespace

    import torch

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    banks = stack_experts(engine.model, pinned=False)
    layer = min(banks)
    on_gpu = [[e < 2 for e in range(bank.num_experts)] for bank in banks.values()]  # experts 0, 1 resident
    split = lambda loads: (sorted(loads)[:1], sorted(loads)[1:])  # noqa: E731  (the overlap needs a copy)
    executor = OffloadExecutor(banks, on_gpu, "cpu", split, overlap_copies=overlap)
    queue = executor._queue_gpu

    def slow_queue(*args, **kwargs):
        time.sleep(0.3)
        return queue(*args, **kwargs)

    monkeypatch.setattr(executor, "_queue_gpu", slow_queue)
    x = torch.randn(4, engine.config.hidden_size)
    ids = torch.tensor([[0, 2], [1, 3], [0, 3], [1, 2]])
    executor.expert_outputs(SimpleNamespace(layer=layer), x, ids)
    stats = executor.stats
    assert (stats.cpu_experts, stats.copied_experts, stats.gpu_experts) == (1, 1, 2)
    assert stats.layer_ms >= 300 and stats.cpu_ms < 150


@pytest.mark.parametrize("cpu_takes", ["lightest", "all but the heaviest"])
def test_a_cpu_share_of_few_pairs_is_handed_their_tokens_alone(tiny_checkpoint, monkeypatch, cpu_takes):
    """A prefill layer whose CPU computes fewer pairs than there are tokens moves those pairs' tokens to the host and
    their results back, not the whole activations; every output matches the all-resident host path. A CPU share of
    more pairs than tokens still takes every token (the pairs would repeat them)."""
    import torch

    from moedesk.engine.offload import offload_executor

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    banks = stack_experts(engine.model, pinned=False)
    layer = sorted(banks)[0]
    experts = banks[layer].num_experts
    # The lightest of the odd experts (the even ones resident), or every expert but the heaviest (none resident).
    offload = (lambda e: e % 2) if cpu_takes == "lightest" else (lambda e: True)
    placement = [[not offload(e) for e in range(b.num_experts)] for _, b in sorted(banks.items())]

    def split(loads):
        order = sorted(loads, key=lambda e: (loads[e], e))
        cpu = order[:1] if cpu_takes == "lightest" else order[:-1]
        return sorted(cpu), [e for e in order if e not in cpu]

    executor = OffloadExecutor(banks, placement, "cpu", split, overlap_copies=True)
    reference = OffloadExecutor(banks, [[True] * b.num_experts for _, b in sorted(banks.items())], "cpu",
                                POLICIES["all-cpu"])
    reference.runs_on_device = lambda layer: False
    calls, real = [], offload_executor.experts_forward_routed
    monkeypatch.setattr(offload_executor, "experts_forward_routed",
                        lambda x, pair_expert, k, *a, **kw: calls.append((len(x), len(pair_expert), k)) or
                        real(x, pair_expert, k, *a, **kw))
    moe = next(b.moe for b in engine.model.layers if hasattr(b, "moe") and b.moe.layer == layer)
    g = torch.Generator().manual_seed(1)
    tokens = 40
    x = torch.randn(tokens, engine.config.hidden_size, generator=g)
    ids = torch.rand(tokens, experts, generator=g).topk(2, dim=1).indices
    assert torch.allclose(executor.expert_outputs(moe, x, ids), reference.expert_outputs(moe, x, ids), atol=1e-5)
    counts = torch.bincount(ids.view(-1), minlength=experts).tolist()
    offloaded = {e: n for e, n in enumerate(counts) if n and offload(e)}
    cpu, _ = split(offloaded)
    pairs = sum(offloaded[e] for e in cpu)
    [(rows, pair_rows, k)] = calls
    assert (pairs < tokens) == (cpu_takes == "lightest")  # each case takes its own path
    if pairs < tokens:
        assert (rows, pair_rows, k) == (pairs, pairs, 1)
    else:
        assert (rows, pair_rows, k) == (tokens, 2 * tokens, 2)
    assert executor.stats.cpu_experts == len(cpu)


@pytest.mark.gpu
def test_on_cuda_a_cpu_share_of_few_pairs_matches_every_token_sent_to_the_host(monkeypatch):
    """The CUDA side of the test above: pinned banks, copy runs on the copy stream, the CPU's call beside them; the
    CPU's few pairs gathered on the device and scattered back give what the whole activations sent to the host give."""
    import torch

    from moedesk.engine.offload import offload_executor
    from moedesk.kernels.expert_weights import ExpertWeights

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, width, experts, top_k, tokens = 512, 256, 16, 4, 128
    g = torch.Generator().manual_seed(0)
    stack = ExpertWeights((torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5).bfloat16(),
                          (torch.randn(experts, hidden, width, generator=g) / width ** 0.5).bfloat16(), hidden, width)
    banks = {layer: stack.pin_memory() for layer in (0, 1)}
    on_gpu = [[e in (0, 5) for e in range(experts)] for _ in banks]

    def two_lightest_on_the_cpu(loads):
        order = sorted(loads, key=lambda e: (loads[e], e))
        return sorted(order[:2]), order[2:]

    x = torch.randn(tokens, hidden, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    calls, real = [], offload_executor.experts_forward_routed
    monkeypatch.setattr(offload_executor, "experts_forward_routed",
                        lambda x_, pe, k, *a, **kw: calls.append(k) or real(x_, pe, k, *a, **kw))
    outputs = {}
    for name in ("their tokens", "every token"):
        if name == "every token":
            monkeypatch.setattr(offload_executor, "_gathers_cpu_share", lambda *a: False)
        executor = OffloadExecutor(banks, on_gpu, "cuda", two_lightest_on_the_cpu, overlap_copies=True,
                                   copy_runs=lambda loads, copy: [len(copy)])
        outputs[name] = [executor.expert_outputs(SimpleNamespace(layer=layer), x, ids).float().cpu()
                         for layer in (0, 1, 0)]
        assert executor.stats.cpu_experts == 3 * 2
    assert calls == [1, 1, 1, top_k, top_k, top_k]
    for got, want in zip(outputs["their tokens"], outputs["every token"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
