"""A prefill step's copied experts computed in copy runs, one grouped launch each (engine.offload.assignment's
copy_runs and grouped_copies pricing, OffloadExecutor's copy_runs): the timeline's arithmetic, the split priced from the
numbers session 36 measured on the H200 box, and the executor's results on the simulated tier."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moedesk.engine.offload import offload_executor as oe
from moedesk.engine.offload.assignment import (GROUPED_COPIES_MIN_LOAD, Contended, assign_offloaded, assignment_for,
                                               copy_run_limit, copy_runs_gpu_ms, copy_runs, mean_load)
from moedesk.engine.offload.latency_model import ProfileError, fit_latency_model
from moedesk.engine.offload.offload_executor import OffloadExecutor, stack_experts
from moedesk.engine.runtime import Engine
from moedesk.kernels.expert_weights import ExpertWeights


def timeline_model(link=1.0, queue=0.5, launch=2.0, gpu=lambda tokens: 3.0):
    return SimpleNamespace(copy_expert_ms=link, copy_queue_ms=queue, copy_launch_at=lambda tokens: launch,
                           gpu_expert_ms=gpu)


def test_the_copy_runs_timeline_queues_the_next_runs_copies_before_this_runs_launch():
    model = timeline_model()
    # One run: copies queued at 0.5 and 1.0 land at 1.5 and 2.5; the launch is queued at 3.0; computed by 6.0.
    assert copy_runs_gpu_ms([4, 4], [2], model) == pytest.approx(6.0)
    # Two: both runs' copies first (ready 1.5, 2.5), launches at 3.0 and 5.0: 6.0, then 9.0.
    assert copy_runs_gpu_ms([4, 4], [1, 1], model) == pytest.approx(9.0)
    assert copy_runs({0: 8, 1: 8}, [0, 1], model) == [2]  # a dear launch: one run
    # A cheap launch and compute that grows with the tokens: runs overlap the compute with the link.
    cheap = timeline_model(queue=0.0, launch=0.1, gpu=lambda tokens: float(tokens) / 8)
    assert copy_runs_gpu_ms([8] * 4, [4], cheap) == pytest.approx(8.0)
    assert copy_runs_gpu_ms([8] * 4, [1, 1, 1, 1], cheap) == pytest.approx(5.0)
    assert copy_runs({e: 8 for e in range(4)}, [0, 1, 2, 3], cheap) == [1, 1, 1, 1]
    # Nine: three runs and four both end at 12 (the last run after the last copy); the fewer launches win.
    assert copy_runs_gpu_ms([8] * 9, [3, 2, 2, 2], cheap) == pytest.approx(12.0)
    assert copy_runs({e: 8 for e in range(9)}, list(range(9)), cheap) == [3, 3, 3]


def test_decode_steps_keep_their_copies_one_by_one_and_their_split():
    """A decode step's few tokens an expert: no runs, and the split priced exactly as before."""
    model = fit_latency_model(qwen35_profile(launch=0.55, queue=0.06))
    decode = {e: 1 + (e % 3 == 0) for e in range(40)}  # 16 sequences' top-8 over 256 experts: ~1.3 an expert
    assert mean_load(decode) < GROUPED_COPIES_MIN_LOAD
    assert copy_runs(decode, [0, 1, 2], model) is None
    grouped = assign_offloaded(decode, model, overlap=True, grouped_copies=True)
    assert grouped == assign_offloaded(decode, model, overlap=True)
    assert copy_runs(dict(enumerate(LAYER_LOADS)), [], model) is None  # nothing copied
    # Sixteen sequences on a skewed routing: 128 picks over 28 experts, ~4.6 an expert. Priced as copy runs this
    # step copied experts and ran slower than with none on the GPU box (docs/measurements.md, "Session 58").
    skewed = {e: 4 + (e < 16) for e in range(28)}
    assert sum(skewed.values()) == 128 and mean_load(skewed) < GROUPED_COPIES_MIN_LOAD
    assert copy_runs(skewed, [0, 1, 2], model) is None
    assert assign_offloaded(skewed, model, overlap=True, grouped_copies=True) == assign_offloaded(skewed, model,
                                                                                                  overlap=True)


# Tokens per active expert of a 512-token prefill in the third MoE layer of the synthetic Qwen3.5-35B-A3B (bench's
# random weights, prompt seed 0, as profile_prefill.py runs it), counted by the executor on the shared dev CPU.
LAYER_LOADS = [271] * 6 + [265, 264, 220, 211, 166, 155, 140, 109, 99, 89, 81, 80, 62, 59, 38, 38, 32, 27, 23, 22, 22,
                           18, 16, 16, 15, 13, 12, 11, 8, 8, 7, 6, 6] + [5] * 4 + [4] * 5 + [3] * 2 + [2] * 13 + [1] * 60


def qwen35_profile(launch: float, queue: float | None = None) -> dict:
    """Session 36's start-up profile of a Qwen3.5-35B-A3B q4_k expert on the H200 box (profile_prefill.txt: one
    expert's CPU and GPU times, its copy, the read rate); the CPU's shares at prefill loads are session 35's q4_k
    calls of eight on AMX (Qwen3's F = 768, scaled to 512) times 1.35, which matches this run's CPU call (116 ms for
    1,271 experts); the contention factors are session 35's Qwen3 ones. launch: host ms a copied expert costs queued
    one by one (copy and compute), queue: a copy alone."""
    shares = {8: 0.26, 16: 0.453, 32: 0.78, 64: 1.44}
    points = {"cpu_expert_ms": {1: 0.0653, 2: 0.0661, 4: 0.106, 8: 0.116, 16: 0.172, 32: 0.273, 64: 0.475,
                                128: 0.945, 256: 1.59},
              "gpu_expert_ms": {1: 0.145, 4: 0.146, 16: 0.137, 64: 0.414, 256: 0.405, 1024: 0.397, 4096: 0.269},
              "copy_expert_ms": 0.0483, "expert_bytes": 1_769_472, "cpu_read_gbs": 125.0,
              "cpu_prefill_ms": {"amx": {n: 1.35 * ms for n, ms in shares.items()}}, "cpu_prefill_experts": 8,
              "cpu_path": "amx", "cpu_slowdown_during_copy": {1: 1.20, 4: 1.15, 16: 1.05},
              "copy_slowdown_during_cpu": {1: 1.15, 4: 1.09, 16: 1.06}, "copy_launch_ms": 0.25,
              "copy_launch_prefill_ms": {16: launch, 64: launch}}
    if queue is not None:
        points["copy_queue_prefill_ms"] = queue
    return points


def test_qwen35s_prefill_step_was_bound_by_launching_each_copied_expert_not_by_the_cpu():
    """Session 36 (profile_prefill.py on the H200): a layer's experts' call took 14-16 ms, the CPU's call 9.7 of it;
    the trace shows the host thread queueing one copied expert's compute after another (0.66 ms each, 0.12 for its
    copy) until the step's end, the CPU done ~4 ms before. Priced one by one at the launch measured with the CPU
    idle (0.55), the split balanced both sides near 7.6 ms; at the 0.9 a copied expert really cost the host beside
    the CPU's call, the GPU's side is the step's critical path. Grouped (one launch, a copy queued at ~0.06), the
    split copies three times as many experts and the step is predicted at half or less."""
    loads = dict(enumerate(LAYER_LOADS))
    assert len(loads) == 123 and sum(loads.values()) == 4096
    before = assign_offloaded(loads, fit_latency_model(qwen35_profile(launch=0.55)), overlap=True)
    assert 8 <= len(before.copy) <= 20
    assert before.cpu_finish_ms == pytest.approx(before.gpu_finish_ms, rel=0.1)
    measured = assignment_for(loads, before.copy, Contended(fit_latency_model(qwen35_profile(launch=0.9)),
                                                             mean_load(loads), overlap=True))
    assert measured.gpu_finish_ms > 1.4 * measured.cpu_finish_ms  # the CPU finished first
    assert 11 < measured.makespan_ms < 14

    model = fit_latency_model(qwen35_profile(launch=0.78, queue=0.06))
    after = assign_offloaded(loads, model, overlap=True, grouped_copies=True)
    assert len(after.copy) >= 3 * len(before.copy)
    assert after.makespan_ms < 0.35 * measured.makespan_ms
    assert max(loads[e] for e in after.cpu) <= min(loads[e] for e in after.copy)  # the CPU keeps the lightest
    # The executor's runs: with a copy queued slower than the link carries it, one launch; its timeline agrees
    # with the split's price of the GPU's side.
    sizes = copy_runs(loads, list(after.copy), model)
    assert sizes == [len(after.copy)]
    timeline = copy_runs_gpu_ms([loads[e] for e in after.copy], sizes, model)
    assert timeline == pytest.approx(after.gpu_finish_ms, rel=0.15)


def test_a_copy_run_holds_no_more_experts_than_its_scratch_allows():
    """gpt-oss-120b's experts (H 2880, F 2880) dequantised to bf16 take 50 MB each: 21 a run within a GiB."""
    assert copy_run_limit(2880, 2880) == 21 and copy_run_limit(2048, 512) == 170 and copy_run_limit(10**5, 10**5) == 1
    cheap = timeline_model(queue=0.0, launch=0.1, gpu=lambda tokens: float(tokens) / 4)
    loads = {e: 16 for e in range(100)}
    # MAX_COPY_RUNS counts from the fewest the limit allows (5) up: a dear launch takes the fewest, a cheap one
    # the most tried.
    assert copy_runs(loads, list(range(100)), timeline_model(), limit=21) == [20] * 5
    assert copy_runs(loads, list(range(100)), cheap, limit=21) == [13] * 4 + [12] * 4


def test_the_profile_reads_a_copys_queueing_and_refuses_a_bad_one():
    assert fit_latency_model(qwen35_profile(0.5, queue=0.06)).copy_queue_ms == pytest.approx(0.06)
    assert fit_latency_model(qwen35_profile(0.5)).copy_queue_ms == 0.0  # older profiles: the link alone paces
    with pytest.raises(ProfileError, match="copy_queue_prefill_ms"):
        fit_latency_model(qwen35_profile(0.5, queue=-1.0))


def test_copy_runs_are_sorted_by_id_and_neighbouring_ids_share_a_copy():
    assert oe._runs_by_id([9, 3, 4, 7, 5, 1], [4, 2]) == [[3, 4, 7, 9], [1, 5]]
    assert oe._id_spans([3, 4, 5, 7, 9, 10]) == [(3, 3, 0), (7, 1, 3), (9, 2, 4)]
    with pytest.raises(AssertionError):
        oe._runs_by_id([1, 2, 3], [2])


@pytest.fixture
def mixtral(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    return engine, stack_experts(engine.model, pinned=False)


@pytest.mark.parametrize("resident", [0, 3])
def test_grouped_copies_compute_what_copies_one_by_one_do(mixtral, resident):
    """With or without resident experts before them (whose group ends precede the runs' in the index)."""
    engine, banks = mixtral
    layer = min(banks)
    experts = banks[layer].num_experts
    nothing = [[e < resident for e in range(bank.num_experts)] for bank in banks.values()]
    torch.manual_seed(0)
    x = torch.randn(24, engine.config.hidden_size)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(24)])
    moe = SimpleNamespace(layer=layer)
    outputs, staged = {}, {}
    for name, runs in (("one by one", None), ("grouped", lambda loads, copy: [2, len(copy) - 2]),
                         ("all-cpu", None)):
        # copies in descending id (decide's order), which the runs sort back within themselves
        decide = (lambda loads: (sorted(loads), [])) if name == "all-cpu" else \
            (lambda loads: ([], sorted(loads, reverse=True)))
        executor = OffloadExecutor(banks, nothing, "cpu", decide, copy_runs=runs)
        outputs[name] = executor.expert_outputs(moe, x, ids).clone()
        staged[name] = executor.staging_stack
        assert executor.stats.copied_experts == (0 if name == "all-cpu" else experts - resident)
        assert executor.stats.gpu_experts == resident
    torch.testing.assert_close(outputs["grouped"], outputs["one by one"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["grouped"], outputs["all-cpu"], rtol=1e-4, atol=1e-4)
    # Each run holds its experts in id order, in consecutive slots: the two highest ids, then the others.
    offloaded = list(range(resident, experts))
    slots = offloaded[-2:] + offloaded[:-2]
    host = banks[layer]
    for slot, e in enumerate(slots):
        assert torch.equal(staged["grouped"].gate_up[slot], host.gate_up[e])
        assert torch.equal(staged["grouped"].down[slot], host.down[e])


def greedy_offloaded(tiny_checkpoint, new_tokens: int, executor_options: dict, setup=lambda executor: None):
    """Tiny Qwen2-MoE with every expert offloaded, half of each step's on the CPU and half copied, decoded greedily
    through an OffloadExecutor made with `executor_options` (and `setup` on it): (the engine, its tokens,
    transformers' tokens for the same prompt)."""
    from moedesk.engine.requests import Request, SamplingParams
    from tests.reference import hf_greedy, hf_model

    folder = tiny_checkpoint("qwen2_moe")
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = hf_greedy(hf_model(folder), prompt, new_tokens, eos)
    banks = stack_experts(engine.model, pinned=False)
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    half = lambda loads: (sorted(loads)[1::2], sorted(loads)[::2])  # noqa: E731
    engine.executor = OffloadExecutor(banks, nothing, "cpu", half, **executor_options)
    setup(engine.executor)
    [done] = engine.generate([Request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0))])
    return engine, done.token_ids, expected


def test_grouped_copies_keep_the_reference_tokens(tiny_checkpoint):
    grouped = []  # the steps whose copies went in copy runs: the path under test ran, not only one by one
    engine, tokens, expected = greedy_offloaded(
        tiny_checkpoint, 12, dict(overlap_copies=True,
                                  copy_runs=lambda loads, copy: grouped.append(len(copy)) or [1] * len(copy)))
    assert tokens == expected
    assert engine.executor.stats.copied_experts > 0 and sum(grouped) == engine.executor.stats.copied_experts


def expert_stack(fmt: str, experts: int, hidden: int, width: int) -> ExpertWeights:
    """Random experts of `fmt`: bf16 scaled as a trained layer's (seeded), else packed (test_gpu_quant_kernel's)."""
    if fmt != "bf16":
        from tests.kernels.test_gpu_quant_kernel import random_experts

        return random_experts(experts, hidden, width, fmt)
    g = torch.Generator().manual_seed(0)
    return ExpertWeights((torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5).bfloat16(),
                         (torch.randn(experts, hidden, width, generator=g) / width ** 0.5).bfloat16(), hidden, width)


def copied_steps(fmt: str, device: str):
    """Four steps (layers 0, 1, 2, then 0 again) in which every expert but the resident 0 and 5 is copied, computed
    with each copied expert alone and in copy runs of 3, 5 and the rest: (x, ids, the experts, {"alone": outputs,
    "grouped": outputs}). On CUDA the copies go on the copy stream, one event a run, the slots reused by the next step
    only after its kernels; on the CPU the simulated tier copies synchronously. 32 tokens an expert on average: q4_k's
    prefill route (bf16 scratch) for some experts, the tensor-core tiles for others."""
    hidden, width, experts, top_k, tokens = 512, 256, 16, 4, 128
    stack = expert_stack(fmt, experts, hidden, width)
    banks = {layer: stack.pin_memory() if device == "cuda" else stack for layer in (0, 1, 2)}
    on_gpu = [[e in (0, 5) for e in range(experts)] for _ in banks]
    copy_all = lambda loads: ([], sorted(loads, key=lambda e: -loads[e]))  # noqa: E731
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(device)
    results = {}
    for name, runs in (("alone", None), ("grouped", lambda loads, copy: [3, 5, len(copy) - 8])):
        executor = OffloadExecutor(banks, on_gpu, device, copy_all, copy_runs=runs)
        results[name] = [executor.expert_outputs(SimpleNamespace(layer=layer), x, ids).float().cpu()
                         for layer in (0, 1, 2, 0)]
        assert executor.stats.copied_experts == 4 * (experts - 2) and executor.stats.gpu_experts == 4 * 2
    return x.cpu(), ids.cpu(), stack, results


_BF16 = 2.0 ** -9  # bf16's unit roundoff: rounding to nearest moves a value by at most 2^-9 of itself
_SUMS = 2.0 ** -23  # a float32 accumulator's step per addition, truncating (as tensor cores may) rather than rounding


def _bf16_weight_error(w: torch.Tensor) -> torch.Tensor:
    """How far a weight moves as a bf16 tile operand: not at all where it is a bf16 value (every mxfp4 weight is:
    two bits of E2M1 times a power of two), else one bf16 rounding of its float32 form."""
    return torch.where(w.to(torch.bfloat16).double() == w, 0.0, (_BF16 + _SUMS) * w.abs())


def rounding_bound(x, gate_up, down):
    """(the SwiGLU expert's output in float64, a bound on how far bf16 arithmetic may move each element) for x [N, H]
    (bf16 values) and the expert's dequantised weights, gate_up [2F, H] and down [H, F] (float64).

    The bound follows every rounding either GPU route makes (kernels.gpu_quant): the weights as bf16 tile operands,
    float32 sums, gate and up rounded to bf16 (the scratch route's grouped GEMM), the activation rounded to bf16 for
    the down projection, the output rounded to bf16; each error carried forward through the next step's terms."""
    h = x @ gate_up.T
    dh = x.abs() @ _bf16_weight_error(gate_up).T + x.shape[1] * _SUMS * (x.abs() @ gate_up.abs().T)
    dh = dh + _BF16 * (h.abs() + dh)
    (gate, up), (dgate, dup) = h.chunk(2, dim=-1), dh.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    dact = 1.1 * dgate * (up.abs() + dup) + torch.nn.functional.silu(gate).abs() * dup  # |silu'| < 1.1 everywhere
    dact = dact + _BF16 * (act.abs() + dact)
    y = act @ down.T
    reach = act.abs() + dact
    dy = dact @ down.abs().T + reach @ _bf16_weight_error(down).T + down.shape[1] * _SUMS * (reach @ down.abs().T)
    # x 1.01: float32's elementwise errors (silu's exp) and the second-order terms, each far below 2^-20 of a term
    return y, 1.01 * (dy + _BF16 * (y.abs() + dy))


def packed_reference(x, ids, stack: ExpertWeights):
    """Row t * K + r: expert ids[t, r] of `stack` applied to x[t] in float64, and its `rounding_bound`."""
    gate_up, down = (t.double() for t in stack.dense(torch.float32))
    pairs = ids.reshape(-1)
    want = torch.empty(len(pairs), x.shape[1], dtype=torch.float64)
    bound = torch.empty_like(want)
    for e in pairs.unique().tolist():
        rows = (pairs == e).nonzero().squeeze(1)
        want[rows], bound[rows] = rounding_bound(x[rows // ids.shape[1]].double(), gate_up[e], down[e])
    return want, bound


def assert_within(got, want, bound, what: str):
    outside = (got.double() - want).abs() > bound
    if outside.any():
        worst = ((got.double() - want).abs() / bound).argmax()
        raise AssertionError(f"{what}: {int(outside.sum())} of {outside.numel()} elements beyond bf16's rounding of "
                             f"float64; worst {got.flatten()[worst]:.4g} for {want.flatten()[worst]:.4g}, bound "
                             f"{bound.flatten()[worst]:.3g}")


@pytest.mark.parametrize("fmt", ["q4_k", "mxfp4"])
def test_packed_copies_lie_within_bf16s_rounding_of_float64_and_a_wrong_expert_does_not(fmt):
    """The simulated tier's copied experts, alone and in runs, within `rounding_bound` of float64; so are the GPU
    routes' roundings, modelled here in float64 (bf16 scratch: gate and up rounded; tiles: kept in float32), while
    a step that took each pair's neighbouring expert is far outside it: the bound tells rounding from a wrong slot."""
    x, ids, stack, results = copied_steps(fmt, "cpu")
    want, bound = packed_reference(x, ids, stack)
    for name, outputs in results.items():
        for step, got in enumerate(outputs):
            assert_within(got, want, bound, f"{fmt} {name} step {step}")
    bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    gate_up, down = (bf16(t.double()) for t in stack.dense(torch.float32))
    pairs = ids.reshape(-1)
    for scratch in (True, False):
        modelled = torch.empty_like(want)
        for e in pairs.unique().tolist():
            rows = (pairs == e).nonzero().squeeze(1)
            h = (x[rows // ids.shape[1]].double() @ gate_up[e].T).float().double()
            gate, up = (bf16(h) if scratch else h).chunk(2, dim=-1)
            modelled[rows] = bf16((bf16(torch.nn.functional.silu(gate) * up) @ down[e].T).float().double())
        assert_within(modelled, want, bound, f"{fmt} modelled {'scratch' if scratch else 'tiles'}")
    wrong, _ = packed_reference(x, (ids + 1) % stack.num_experts, stack)
    assert ((wrong - want).abs() > bound).float().mean() > 0.25


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "q4_k", "mxfp4"])
def test_grouped_copies_on_the_gpu_compute_what_copies_one_by_one_do(fmt):
    """The CUDA side of `copied_steps`. Alone and in a run a copied expert may take different gpu_quant routes (by
    its rows: bf16 scratch rounds gate and up, the tiles keep them in float32), so packed experts are checked, both
    ways, against float64 within `rounding_bound`; bf16 ones round at the same places either way."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, ids, stack, results = copied_steps(fmt, "cuda")
    if fmt == "bf16":
        for alone, grouped in zip(results["alone"], results["grouped"]):
            torch.testing.assert_close(grouped, alone, rtol=2e-2, atol=2e-2)
    else:
        want, bound = packed_reference(x, ids, stack)
        for name, outputs in results.items():
            for step, got in enumerate(outputs):
                assert_within(got, want, bound, f"{fmt} {name} step {step}")
    # The same step again, its slots reused after three steps' copies
    torch.testing.assert_close(results["grouped"][3], results["grouped"][0], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_a_copys_queueing_is_host_time_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moedesk.engine.offload.profiler import copy_queue_prefill_ms

    hidden, width = 2048, 1024
    from tests.offload.test_gpu_profiler import pinned_bf16_experts

    w = pinned_bf16_experts(8, hidden, width)
    ms = copy_queue_prefill_ms(w, torch.device("cuda"), copies=4)["copy_queue_prefill_ms"]
    assert 0.002 < ms < 1.0  # two API calls a copy, never the 12 MiB copy waited for (~0.3 ms)


def test_the_exact_split_of_a_grouped_copies_step_equals_brute_force():
    """The step's one launch (`copy_step_ms`) comes after the copies' pipeline: the exact search once folded it into a
    partial split's GPU finish, where a later group's link-bound copies absorbed it, and chose slower splits than the
    best."""
    import itertools
    import random

    from moedesk.engine.offload import assignment

    rng = random.Random(3)
    for _ in range(120):
        model = fit_latency_model(qwen35_profile(launch=rng.uniform(0.2, 1.2), queue=rng.uniform(0.0, 0.1)))
        loads = {e: rng.choice([4, 8, 16, 32, 64, 128]) for e in range(rng.randint(3, 9))}
        groups = assignment._group(loads, Contended(model, mean_load(loads), overlap=True, grouped_copies=True), 0.0,
                                   mean_load(loads))
        assert groups.copy_step > 0
        best = min(groups.makespan(x) for x in itertools.product(*(range(m + 1) for m in groups.sizes)))
        start = assignment._greedy(groups, [0] * len(groups.sizes))
        assert groups.makespan(assignment._exact(groups, start)) == pytest.approx(best, abs=1e-9)


def test_small_experts_stay_in_one_grouped_launch_at_prefill_loads_and_large_ones_do_not():
    """Qwen3-30B-A3B's experts (H 2048, F 768) one GEMM each were launch-bound at prefill; Mixtral's (4096, 14336) ran
    faster so from 16 tokens (docs/measurements.md, "The offload path")."""
    from moedesk.engine.offload.assignment import SMALL_EXPERT_WEIGHTS, resident_grouped

    prefill = [145] * 20  # a mixed layer's resident experts in session 37's Qwen3 prefill 512
    assert resident_grouped(prefill, 2048, 768, grouped_max=64)
    assert not resident_grouped([256] * 4, 4096, 14336, grouped_max=64)
    assert resident_grouped([64, 3, 0], 4096, 14336, grouped_max=64)  # decode's few: grouped, whatever the size
    # The dequantising launch spans every resident slot: a stack past a copy run's scratch goes one by one.
    assert resident_grouped(prefill, 2048, 768, 64, slots=copy_run_limit(2048, 768))
    assert not resident_grouped(prefill, 2048, 768, 64, slots=copy_run_limit(2048, 768) + 1)
    edge = SMALL_EXPERT_WEIGHTS // 3
    assert resident_grouped([100], edge, 1, 64) and not resident_grouped([100], edge + 1, 1, 64)
    assert not resident_grouped([0, 0], 2048, 768, 64) and not resident_grouped([], 2048, 768, 64)


@pytest.mark.parametrize("grouped_above", [False, True])
def test_a_prefills_resident_experts_over_the_decode_limit_compute_the_same_grouped_or_one_by_one(
        mixtral, monkeypatch, grouped_above):
    """The tiny Mixtral's experts are small, so a resident expert with more than GROUPED_MAX_TOKENS tokens no longer
    sends the layer's resident experts one GEMM each; forced back (large experts), the outputs are the same."""
    engine, banks = mixtral
    layer = min(banks)
    experts = banks[layer].num_experts
    resident = [[e < 3 for e in range(bank.num_experts)] for bank in banks.values()]
    tokens = oe.GROUPED_MAX_TOKENS + 40
    torch.manual_seed(1)
    x = torch.randn(tokens, engine.config.hidden_size)
    ids = torch.stack([torch.tensor([0, 3 + t % (experts - 3)]) for t in range(tokens)])  # expert 0: every token
    launches, listed = [], []
    real = oe.grouped_experts_forward
    monkeypatch.setattr(oe, "grouped_experts_forward",
                        lambda *a: launches.append(len(a[0])) or listed.append(a[3].tolist()) or real(*a))
    if not grouped_above:
        monkeypatch.setattr(oe, "resident_grouped", lambda sizes, *a: max(sizes) <= oe.GROUPED_MAX_TOKENS)
    executor = OffloadExecutor(banks, resident, "cpu", lambda loads: (sorted(loads), []))
    got = executor.expert_outputs(SimpleNamespace(layer=layer), x, ids)
    reference = OffloadExecutor(banks, [[False] * bank.num_experts for bank in banks.values()], "cpu",
                                lambda loads: (sorted(loads), []))
    expected = reference.expert_outputs(SimpleNamespace(layer=layer), x, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert executor.stats.gpu_experts == 1  # expert 0 alone of the resident ones has tokens
    assert launches == ([tokens] if grouped_above else [])
    assert listed == ([[executor.banks[layer].gpu_slot[0]]] if grouped_above else [])  # the launch's one slot with tokens


def test_the_cpu_calls_time_beside_the_copies_queueing_is_the_calls_own(mixtral, monkeypatch):
    """With the CPU's call beside the queueing of the GPU's share (overlap_copies), `cpu_expert_ms` counts the call
    once: the join's wait is part of the call, not time to add to it (it read 2 x call - queueing before)."""
    import time

    engine, banks = mixtral
    layer = min(banks)
    call_s, queue_s = 0.12, 0.08
    real_call, real_queue = oe.experts_forward_routed, OffloadExecutor._queue_gpu

    def slow_call(*args, **kwargs):
        time.sleep(call_s)
        return real_call(*args, **kwargs)

    def slow_queue(self, *args, **kwargs):
        time.sleep(queue_s)
        return real_queue(self, *args, **kwargs)

    monkeypatch.setattr(oe, "experts_forward_routed", slow_call)
    monkeypatch.setattr(OffloadExecutor, "_queue_gpu", slow_queue)
    nothing = [[False] * bank.num_experts for bank in banks.values()]
    half = lambda loads: (sorted(loads)[1::2], sorted(loads)[::2])  # noqa: E731
    executor = OffloadExecutor(banks, nothing, "cpu", half, overlap_copies=True)
    torch.manual_seed(0)
    x = torch.randn(8, engine.config.hidden_size)
    ids = torch.stack([torch.randperm(banks[layer].num_experts)[:2] for _ in range(8)])
    executor.expert_outputs(SimpleNamespace(layer=layer), x, ids)
    assert executor.stats.copied_experts > 0 and executor.stats.cpu_experts > 0
    assert 1e3 * call_s <= executor.stats.cpu_ms < 1e3 * (2 * call_s - queue_s) - 20


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "q4_k", "mxfp4"])
def test_small_resident_experts_past_the_decode_limit_on_the_gpu_compute_what_one_gemm_each_does(fmt, monkeypatch):
    """`resident_grouped` on CUDA: 15 resident experts with ~128 tokens each (past GROUPED_MAX_TOKENS) in one grouped
    launch, against one GEMM each; packed experts also against float64 within `rounding_bound`."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, width, experts, top_k, tokens = 512, 256, 16, 4, 512
    stack = expert_stack(fmt, experts, hidden, width)
    banks = {0: stack.pin_memory()}
    on_gpu = [[e != 7 for e in range(experts)]]
    torch.manual_seed(2)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).cuda()
    launches, real = [], oe.grouped_experts_forward
    monkeypatch.setattr(oe, "grouped_experts_forward", lambda *a: launches.append(len(a[0])) or real(*a))
    copy_all = lambda loads: ([], sorted(loads))  # noqa: E731
    grouped = OffloadExecutor(banks, on_gpu, "cuda", copy_all).expert_outputs(
        SimpleNamespace(layer=0), x, ids).float().cpu()
    assert launches and launches[0] > oe.GROUPED_MAX_TOKENS * (experts - 1)  # the resident share, grouped
    monkeypatch.setattr(oe, "resident_grouped", lambda sizes, *a: False)
    alone = OffloadExecutor(banks, on_gpu, "cuda", copy_all).expert_outputs(
        SimpleNamespace(layer=0), x, ids).float().cpu()
    if fmt == "bf16":
        torch.testing.assert_close(grouped, alone, rtol=2e-2, atol=2e-2)
    else:
        want, bound = packed_reference(x.cpu(), ids.cpu(), stack)
        assert_within(grouped, want, bound, f"{fmt} resident grouped")
        assert_within(alone, want, bound, f"{fmt} resident one GEMM each")
