"""Engine.load with experts offloaded: loader straight into host banks, cached profile and popularity,
placement under a budget, per-request expert stats, and GPU out-of-memory back-off.

The "GPU" tier is simulated on the CPU here (offload=True on a CPU engine); the same code runs on a GPU.
"""
import json

import numpy as np
import pytest
import torch

from moedesk.engine.offload import calibration
from moedesk.engine.offload.gpu_budget import non_expert_bytes
from moedesk.engine.errors import MoedeskError
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    return tmp_path


def _generate(engine, prompts=PROMPTS, batch_size=2):
    ids = [engine.tokenizer.encode(p) for p in prompts]
    done = {c.tag: c for c in engine.generate([Request(p, GREEDY, tag=i) for i, p in enumerate(ids)], batch_size)}
    return [done[i] for i in range(len(ids))]


def _reference(folder, engine, prompts=PROMPTS):
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    return [hf_greedy(hf_model(folder), engine.tokenizer.encode(p), GREEDY.max_new_tokens, eos) for p in prompts]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_offloaded_engine_matches_transformers_at_every_budget(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    probe = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    expected = _reference(folder, probe)
    total = sum(map(len, probe.expert_map()[0]))
    for fits in (0, 1, total // 2, total):
        engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True,
                             gpu_budget=probe.gpu_budget_for_experts(fits))
        on_gpu, _ = engine.expert_map()
        assert sum(map(sum, on_gpu)) == fits
        assert [c.token_ids for c in _generate(engine)] == expected, fits


def test_an_explicit_budget_holds_the_weights_and_the_whole_context_cache_before_experts(tiny_checkpoint):
    """--gpu-budget is all the GPU memory moedesk may use: the non-expert weights (as the loaded model holds them),
    one sequence's cache at the whole context and attention's workspace come out of it; experts get the rest."""
    folder = str(tiny_checkpoint("mixtral"))
    probe = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=0)
    expert_bytes = probe.orchestra.expert_bytes
    budget_gib = probe.gpu_budget_for_experts(5) + 0.5 * expert_bytes / 2**30  # room for five and a half
    engine = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=budget_gib)
    split = engine.budget_split
    # What stays on the GPU whatever the placement: the estimate from the config (no norms or tables) is a floor.
    held = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    assert non_expert_bytes(engine.config, 4) < split.weights == held
    assert split.kv_cache == engine.context_length * engine.cache.bytes_per_position() > 0 and split.workspace > 0
    assert split.weights + split.kv_cache + split.workspace + split.slack + split.experts == int(budget_gib * 2**30)
    assert engine.expert_stats()["experts_on_gpu"] == 5 == split.experts // expert_bytes
    # The same budget at a quarter of the context: what its cache and workspace leave goes to experts only.
    shorter = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=budget_gib,
                          context_length=engine.context_length // 4)
    assert 4 * shorter.budget_split.kv_cache == split.kv_cache  # (the rotary tables shrink with it too)
    assert shorter.budget_split.experts - split.experts == split.fixed - shorter.budget_split.fixed > 0
    assert shorter.expert_stats()["experts_on_gpu"] > 5


def test_a_budget_too_small_for_the_context_is_refused_before_the_weights_are_read(tiny_checkpoint, monkeypatch):
    from moedesk.engine import runtime

    folder = str(tiny_checkpoint("mixtral"))
    probe = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=0, context_length=128)
    budget_gib = probe.gpu_budget_for_experts(0)  # 128 positions' cache and nothing more
    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: pytest.fail("weights read for a refused budget"))
    with pytest.raises(MoedeskError) as refused:
        Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=budget_gib,
                    context_length=4 * probe.context_length)
    message = str(refused.value)
    assert "\n" not in message and "--gpu-budget" in message
    fits = int(message.split("at most ")[1].split()[0])
    assert probe.context_length <= fits < 4 * probe.context_length
    monkeypatch.undo()
    try:
        engine = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=budget_gib,
                             context_length=fits)
    except MoedeskError as exact:  # before reading, norms and tables are left out: the loaded sizes may take a bit more
        fits_loaded = int(str(exact).split("at most ")[1].split()[0])
        assert 0.9 * fits <= fits_loaded < fits
        engine = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=budget_gib,
                             context_length=fits_loaded)
    assert engine.budget_split.experts >= 0 and engine.expert_stats()["experts_on_gpu"] == 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss", "deepseek_v3",
                                  "glm4_moe_lite"])
def test_the_refusal_before_reading_never_counts_more_than_the_loaded_model_takes(arch, tiny_checkpoint):
    """The check before the weights are read works from the config: it must never refuse a budget the loaded sizes
    fit, so its weights and cache are a floor of what the loaded model and its cache really take."""
    from moedesk.engine.generation.scheduler import default_prefill_chunk
    from moedesk.engine.offload.gpu_budget import model_split

    engine = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    loaded = engine.gpu_budget_split(2**40)
    before = model_split(engine.config, 2**40, engine.context_length, 4, default_prefill_chunk("cpu"))
    assert before.weights <= loaded.weights and before.kv_cache <= loaded.kv_cache, arch
    assert before.workspace == loaded.workspace and before.fixed <= loaded.fixed


def test_experts_are_loaded_into_host_banks_and_the_most_popular_placed(tiny_checkpoint, cache_dir, monkeypatch):
    folder = str(tiny_checkpoint("mixtral"))
    engine = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=0)
    bank = engine.executor.banks[0].host
    # The model's experts are the bank, not a copy: the weights exist once.
    assert engine.model.moe_blocks()[0].experts.gate_up.data_ptr() == bank.gate_up.data_ptr()
    assert sorted(p.name.split("-")[0] for p in cache_dir.glob("*.json")) == ["popularity", "profile"]

    # A second load reads popularity and profile from the cache instead of measuring again.
    monkeypatch.setattr(calibration, "measure_popularity", lambda *_: pytest.fail("calibrated twice"))
    three = engine.gpu_budget_for_experts(3)
    placed = Engine.load(folder, device="cpu", dtype="float32", offload=True, gpu_budget=three)
    popularity = placed.orchestra.popularity
    on_gpu = placed.expert_map()[0]
    chosen = sorted(((popularity[l][e], -l, -e) for l, row in enumerate(on_gpu) for e, g in enumerate(row) if g))
    left = [popularity[l][e] for l, row in enumerate(on_gpu) for e, g in enumerate(row) if not g]
    assert len(chosen) == 3 and min(c[0] for c in chosen) >= max(left)
    assert placed.expert_stats()["experts_on_gpu"] == 3


def test_calibration_counts_two_halves_and_places_by_their_shrunk_estimate(tiny_checkpoint, cache_dir):
    from moedesk.engine.offload.popularity import estimated_popularity

    engine = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    (cached,) = cache_dir.glob("popularity-*.json")
    halves = json.loads(cached.read_text())
    new_tokens = 16  # measure_popularity's default
    layers, top_k = len(engine.model.moe_blocks()), engine.config.num_experts_per_tok
    assert len(halves) == 2 and all(len(h) == layers for h in halves)
    # Each half is the routing of its own prompts (the even-numbered ones, then the odd-numbered ones): its
    # selections are its prompts' tokens x top_k in every layer.
    tok = engine.tokenizer
    prompts = [tok.chat_prompt([{"role": "user", "content": p}]) for p in calibration.calibration_prompts()]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for half, chosen in zip(halves, (prompts[0::2], prompts[1::2])):
        engine.executor.selections.clear()
        list(engine.generate([Request(p, params) for p in chosen], batch_size=4))
        assert half == [engine.executor.selections[layer].tolist() for layer in range(layers)]
        assert [sum(row) for row in half] == [sum(half[0])] * layers and sum(half[0]) > len(chosen) * new_tokens * top_k
    counts, evenness = estimated_popularity(halves)
    assert np.allclose(engine.orchestra.popularity, counts)
    assert engine.expert_stats()["popularity_evenness"] == pytest.approx(evenness, abs=1e-4)

    # A stored file that does not fit the model (edited, or another version's) is measured again, not trusted.
    for damaged in ([[[1, 2]]], {"halves": halves}, [halves[0], [[-1] * len(halves[1][0])] * layers]):
        cached.write_text(json.dumps(damaged))
        again = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32", offload=True,
                            gpu_budget=0)
        assert np.allclose(again.orchestra.popularity, counts)
        assert json.loads(cached.read_text()) == halves


def test_padding_of_a_prompt_batch_goes_to_no_expert(tiny_checkpoint):
    # Prompts of different lengths prefilled together: only their own tokens are routed to experts (the
    # padding's would be wasted work, and would skew the counts placement uses), and the tokens stay.
    engine = Engine.load(str(tiny_checkpoint("qwen2_moe")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)
    one = SamplingParams(max_new_tokens=1, temperature=0)
    engine.executor.selections.clear()
    together = [c.token_ids for c in engine.generate([Request(p, one) for p in ids], batch_size=len(ids))]
    top_k = engine.config.num_experts_per_tok
    assert {int(c.sum()) for c in engine.executor.selections.values()} == {sum(map(len, ids)) * top_k}
    alone = [c.token_ids for p in ids for c in engine.generate([Request(p, one)], batch_size=1)]
    assert together == alone


@pytest.mark.parametrize("on_device", [True, False])
def test_whole_layers_only_where_the_executor_runs_them_without_the_host(on_device):
    # Even routing, a costly round trip, room for a quarter of the experts: whole layers pay only where a
    # fully resident layer runs from the device alone (bf16 on Hopper); elsewhere popularity order stays.
    from types import SimpleNamespace

    from moedesk.engine.offload.orchestration import ExpertOrchestra

    placed = []
    executor = SimpleNamespace(whole_layers_on_device=on_device, hands_over_partly_resident=lambda top_k: False,
                               splits_lone_tokens=False, set_placement=placed.append)
    costs = SimpleNamespace(activation_roundtrip_ms=lambda tokens: 0.3, resident_launch_ms=0.0,
                            cpu_expert_ms=lambda tokens: 0.06)
    popularity = np.full((12, 16), 100)
    popularity[:, 4:8] = 101
    orchestra = ExpertOrchestra(executor, costs, expert_bytes=1, popularity=popularity.tolist(), budget_bytes=0, top_k=8,
                                cache=None)
    plan = orchestra.place(48)
    assert plan.experts_on_gpu == 48 and placed == [plan.as_lists()]
    assert plan.on_gpu.all(axis=1).sum() == (3 if on_device else 0)


@pytest.mark.parametrize("splits", [True, False])
def test_placement_keeps_layers_clear_for_the_lone_token_split_where_the_executor_makes_it(splits):
    # Even routing and the GPU reading two of a lone token's 8 experts from RAM, which the executor does only in layers
    # with nothing resident: what whole layers leave over goes into one layer, not a few into every other.
    from types import SimpleNamespace

    from moedesk.engine.offload.orchestration import ExpertOrchestra

    executor = SimpleNamespace(whole_layers_on_device=True, hands_over_partly_resident=lambda top_k: True,
                               splits_lone_tokens=splits, set_placement=lambda rows: None)
    costs = SimpleNamespace(activation_roundtrip_ms=lambda tokens: 0.035, resident_launch_ms=0.4,
                            cpu_expert_ms=lambda tokens: 0.012, cpu_call_ms=lambda tokens: 0.1,
                            zero_copy_split_ms=(0.2, 0.195, 0.178), zero_copy_top_k=8, split_width_ms=())
    popularity = np.random.default_rng(1).poisson(1000, size=(12, 64)).astype(float)
    orchestra = ExpertOrchestra(executor, costs, expert_bytes=1, popularity=popularity.tolist(), budget_bytes=0,
                                top_k=8, cache=None)
    plan = orchestra.place(3 * 64 + 40)
    assert plan.experts_on_gpu == 3 * 64 + 40 and plan.on_gpu.all(axis=1).sum() == 3
    assert (plan.on_gpu.any(axis=1).sum() == 4) == splits


@pytest.mark.parametrize("hands_over", [True, False])
def test_placement_prices_partly_resident_layers_as_the_executor_runs_them(hands_over):
    # Skewed routing and a high resident launch (docs/measurements.md, "Session 45"): where decode hands partly
    # resident layers over, the graph launches their experts and popularity order keeps every pick on the GPU.
    from types import SimpleNamespace

    from moedesk.engine.offload.orchestration import ExpertOrchestra

    executor = SimpleNamespace(whole_layers_on_device=True, hands_over_partly_resident=lambda top_k: hands_over,
                               splits_lone_tokens=False, set_placement=lambda rows: None)
    costs = SimpleNamespace(activation_roundtrip_ms=lambda tokens: 0.041, resident_launch_ms=0.9,
                            cpu_expert_ms=lambda tokens: 0.746, cpu_call_ms=lambda tokens: 0.169)
    popularity = np.zeros((32, 8))
    for layer in range(32):
        popularity[layer, :4 + layer % 2] = 10 + np.arange(4 + layer % 2)
    orchestra = ExpertOrchestra(executor, costs, expert_bytes=1, popularity=popularity.tolist(), budget_bytes=0,
                                top_k=2, cache=None)
    plan = orchestra.place(151)
    assert (plan.gpu_hit_rate(popularity) == 1.0) == hands_over


def test_a_cache_starts_from_the_fixed_placement_whole_layers_kept_and_prices_swaps_by_its_costs():
    # Costs that make whole layers pay on the device: the cache keeps them (no handoff, inside the graphs) and
    # follows the routing in the rest, its swaps priced by the same latency model; per expert only when asked.
    from types import SimpleNamespace

    from moedesk.engine.offload.expert_cache import CachePolicy, SwapPrice
    from moedesk.engine.offload.orchestration import ExpertOrchestra

    placed, followed = [], []
    executor = SimpleNamespace(whole_layers_on_device=True, hands_over_partly_resident=lambda top_k: False,
                               splits_lone_tokens=False, set_placement=placed.append,
                               follow_routing=lambda policy, price: followed.append((policy, price)))
    costs = SimpleNamespace(activation_roundtrip_ms=lambda tokens: 0.3, resident_launch_ms=0.0,
                            cpu_expert_ms=lambda tokens: 0.06, copy_expert_ms=0.5, copy_launch_ms=0.02)
    popularity = np.full((12, 16), 100)
    popularity[:, 4:8] = 101
    policy = CachePolicy(interval=8)
    orchestra = ExpertOrchestra(executor, costs, expert_bytes=1, popularity=popularity.tolist(), budget_bytes=0,
                                top_k=8, cache=None)
    fixed = orchestra.place(48)
    orchestra.cache = policy
    plan = orchestra.place(48)
    assert plan.on_gpu.all(axis=1).sum() == 3 and (plan.on_gpu == fixed.on_gpu).all()
    assert followed == [(policy, SwapPrice(0.06, 0.5))]  # the copy's bytes: no launch of its own, no recapture
    per_expert = orchestra.place(48, whole_layers=False)
    assert not per_expert.on_gpu.all(axis=1).any() and (per_expert.on_gpu.sum(axis=1) == 4).all()


def test_a_twin_holds_a_placement_of_its_own_over_the_same_host_experts_and_computes_the_same(tiny_checkpoint):
    """Two placements side by side (tests/perf/bench_expert_cache.py): the twin starts with nothing resident, shares
    the host experts, the latency model and the popularity, keeps its own splits, and places without moving the
    original's experts; a forward through either gives the same logits."""
    from moedesk.engine.offload.assignment import RememberedSplit

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    orchestra, model = engine.orchestra, engine.model
    experts = orchestra.expert_bytes
    orchestra.place(3 * experts)
    twin = orchestra.twin()
    assert twin.executor is not orchestra.executor and not any(map(any, twin.executor.on_gpu()))
    assert all(twin.executor.banks[layer].host is bank.host for layer, bank in orchestra.executor.banks.items())
    assert twin.costs is orchestra.costs and twin.popularity == orchestra.popularity and twin.placement is None
    assert isinstance(twin.executor.decide, RememberedSplit) and twin.executor.decide is not orchestra.executor.decide
    before = orchestra.executor.on_gpu()
    twin.place(7 * experts)
    assert sum(map(sum, twin.executor.on_gpu())) == 7 and orchestra.executor.on_gpu() == before
    tokens = torch.tensor([engine.tokenizer.encode(PROMPTS[0])])
    positions = torch.arange(tokens.shape[1])[None]
    last = torch.tensor([tokens.shape[1] - 1])
    logits = [model(tokens, positions, model.new_cache(1, tokens.shape[1], torch.float32, "cpu"), o.executor,
                    logits_at=last) for o in (orchestra, twin)]
    assert torch.allclose(*logits, atol=1e-5)


def test_completions_report_the_expert_work_of_their_steps(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    before = engine.expert_stats()
    assert before["experts_cpu"] + before["experts_copied"] + before["experts_gpu"] == 0  # calibration not counted
    first, *_ = _generate(engine, PROMPTS[:1], batch_size=1)
    experts = first.stats["experts"]
    moe_layers = len(engine.model.moe_blocks())
    steps = len(first.token_ids)  # a prefill step and one decode step per further token
    assert experts["gpu_hit_rate"] == 0.0 and experts["experts_gpu"] == 0
    assert moe_layers * steps <= experts["active_experts"] <= moe_layers * steps * engine.config.num_experts_per_tok * 8
    assert engine.expert_stats()["active_experts"] == experts["active_experts"]  # one request: all the work is its own


def test_gpu_oom_while_generating_moves_experts_to_ram_and_gives_the_same_tokens(tiny_checkpoint):
    folder = tiny_checkpoint("mixtral")
    engine = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=1.0)
    resident = engine.expert_stats()["experts_on_gpu"]
    assert resident == 12
    run = engine.executor.expert_outputs
    failures = iter([True, False, False, True])  # the first call, and a later one after the retry went through

    def flaky(*args, **kwargs):
        if next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return run(*args, **kwargs)

    engine.executor.expert_outputs = flaky
    assert [c.token_ids for c in _generate(engine)] == _reference(folder, engine)
    assert engine.expert_stats()["experts_on_gpu"] == resident // 4
    assert len(engine.warnings) == 2 and all("out of memory" in w for w in engine.warnings)


def test_gpu_oom_with_no_experts_left_is_one_clear_error(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine.executor.expert_outputs = no_memory
    with pytest.raises(MoedeskError, match="GPU out of memory with nothing left to move to RAM"):
        _generate(engine, PROMPTS[:1])


def test_oom_while_placing_lowers_the_budget_with_a_warning(tiny_checkpoint, monkeypatch):
    from moedesk.engine.offload.offload_executor import OffloadExecutor

    place = OffloadExecutor.set_placement

    def at_most_four(self, on_gpu):
        if sum(map(sum, on_gpu)) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        place(self, on_gpu)

    monkeypatch.setattr(OffloadExecutor, "set_placement", at_most_four)
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=1.0)
    resident = engine.expert_stats()["experts_on_gpu"]
    assert 0 < resident <= 4
    assert engine.warnings and "GPU budget lowered" in engine.warnings[0]


def test_dense_models_and_negative_budgets(tiny_checkpoint):
    dense = Engine.load(str(tiny_checkpoint("llama")), device="cpu", dtype="float32", offload=True)
    assert dense.orchestra is None and dense.expert_stats() == {}
    with pytest.raises(MoedeskError, match="--gpu-budget"):
        Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", gpu_budget=-1)
