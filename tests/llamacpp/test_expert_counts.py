"""Per-expert counts on the llama.cpp engine (engine/llamacpp/expert_counts.py): what llama.cpp's routers picked,
read from its graph, against transformers' own routers on the same tiny random checkpoints.

Tiny Qwen3-MoE, gpt-oss and DeepSeek-V3 GGUFs (tests/gguf_from_hf.py: float32 weights, so both sides compute the
same routing) decode three prompts together through the engine; transformers then runs each prompt and its reply
teacher-forced with a hook on every router, and its picks, counted per layer and expert, must equal the engine's.
The engine counts a sample (expert_counts.step_weight): the prompts whole, decode one step in COUNT_EVERY (here 2,
so that a few replies' counted and skipped steps both occur), each pick of a counted step COUNT_EVERY times; the
reference weighs each position alike, and a skipped step must not call the callback for any node.
llama.cpp computes the last layer of most architectures for the tokens whose logits it returns only, so there the
counts cover the last prompt token and each generated one (gpt-oss, Qwen3.5 and Qwen3-Next drop the other tokens
after it). On every family the tests write, the counts add up to tokens x top-k in each MoE layer.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moedesk.engine.llamacpp import expert_counts
from moedesk.engine.llamacpp.expert_counts import chosen_ids, step_weight, topk_layer
from tests.gguf_from_hf import FAMILIES, build

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return", "Experts live in RAM; the popular ones"]
NEW_TOKENS = 6
# Families whose last layer llama.cpp runs for every token (the others: for the tokens whose logits it returns)
WHOLE_LAST_LAYER = {"gpt-oss", "gpt-oss-mxfp4", "qwen35moe", "qwen3next"}
COMPARED = ["qwen3moe", "gpt-oss", "deepseek2"]  # softmax, softmax over the top-k, grouped sigmoid with a bias
COUNT_EVERY = 2  # decode steps per counted one in these tests


@pytest.fixture(autouse=True)
def count_every_other_step(monkeypatch):
    """COUNT_EVERY for the engine's counters, each of which keeps a trace: (weight, nodes read before it) per step."""
    monkeypatch.setattr(expert_counts, "COUNT_EVERY", COUNT_EVERY)
    begin = expert_counts.ExpertCounter.begin_step

    def traced(counter, prefill):
        weight = begin(counter, prefill)
        counter.__dict__.setdefault("trace", []).append((weight, counter.reads))
        return weight

    monkeypatch.setattr(expert_counts.ExpertCounter, "begin_step", traced)


def reads_per_step(counter) -> list[tuple[int, int]]:
    """(weight, nodes the callback read) of each step the counter saw."""
    marks = [reads for _, reads in counter.trace] + [counter.reads]
    return [(weight, marks[i + 1] - marks[i]) for i, (weight, _) in enumerate(counter.trace)]


def test_step_weight_counts_prompts_whole_and_one_decode_step_in_every():
    assert [step_weight(False, step, 4) for step in range(9)] == [4, 0, 0, 0, 4, 0, 0, 0, 4]
    assert step_weight(True, 3, 4) == 1 and step_weight(True, 0, 8) == 1  # prompts whatever the decode phase
    assert [step_weight(False, step, 1) for step in range(3)] == [1, 1, 1]  # every step: the exact count
    # a long run's weighted steps add up to the steps they stand for
    assert sum(step_weight(False, step, 8) for step in range(800)) == 800
    with pytest.raises(ValueError, match="at least 1"):
        step_weight(False, 0, 0)


@pytest.mark.parametrize("bad", ["0", "8,x", "8,-1"])
def test_the_compare_script_takes_only_a_sample_of_one_step_in_at_least_one(bad):
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "tests/perf/compare_llamacpp_engine.py", "--llama-bench", "none",
                          "--count-every", bad], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                         timeout=120)
    assert run.returncode == 2
    assert "--count-every" in run.stderr.strip().splitlines()[-1] and "Traceback" not in run.stderr


def position_weights(prompt: int, fed: int) -> list[int]:
    """What each position of a prompt and its fed-back reply tokens counts for when its sequence decodes in
    lockstep with the others: the prompt's 1, reply token j (fed by decode step j) COUNT_EVERY on every
    COUNT_EVERY-th step."""
    return [1] * prompt + [COUNT_EVERY if j % COUNT_EVERY == 0 else 0 for j in range(fed)]


def test_topk_layer_reads_only_the_routers_choice():
    assert topk_layer(b"ffn_moe_topk-0") == 0 and topk_layer(b"ffn_moe_topk-61") == 61
    for name in (b"ffn_moe_topk", b"ffn_moe_topk-", b"ffn_moe_topk-3 (view)", b"ffn_moe_weights-3", b"attn_norm-3"):
        assert topk_layer(name) is None, name


def test_chosen_ids_reads_the_first_k_of_each_tokens_sorted_experts():
    """llama.cpp's ffn_moe_topk is a view: the first k ids of each token's row of all n_expert sorted ids."""
    sorted_ids = np.array([[5, 2, 7, 0, 1, 3, 4, 6], [1, 0, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]],
                          dtype=np.int32)
    k, tokens, experts = 2, 3, 8
    raw = sorted_ids.tobytes()[:((tokens - 1) * experts + k) * 4]  # ggml_nbytes of the view: first to last element
    ids = chosen_ids(raw, (k, tokens, 1, 1), (4, experts * 4, experts * 4 * tokens, experts * 4 * tokens))
    assert ids.tolist() == [[5, 2], [1, 0], [7, 6]]


def transformers_picks(model, sequences: list[tuple[list[int], list[int], int]], layers: int,
                       experts: int) -> np.ndarray:
    """[layers, experts] counts of the routers' picks as transformers makes them, each sequence (ids, weight per
    position, first token of the last layer) run teacher-forced: every token in every layer but the last, from
    that one on in the last; each pick counted its position's weight times."""
    picks = np.zeros((layers, experts), dtype=np.int64)
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Router"):  # Qwen3MoeTopKRouter, GptOssTopKRouter, DeepseekV3TopkRouter
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            hooks.append(module.register_forward_hook(lambda m, args, out, layer=layer: seen.__setitem__(layer, out[2])))
    assert hooks, "no router modules found"
    try:
        for ids, weights, first_output in sequences:
            seen.clear()
            with torch.no_grad():
                model(torch.tensor([ids]))
            for layer, chosen in seen.items():
                chosen = chosen.reshape(len(ids), -1).numpy()
                w = np.repeat(np.array(weights)[:, None], chosen.shape[1], axis=1)
                if layer == layers - 1:
                    chosen, w = chosen[first_output:], w[first_output:]
                picks[layer] += np.bincount(chosen.flatten(), weights=w.flatten(), minlength=experts).astype(np.int64)
    finally:
        for hook in hooks:
            hook.remove()
    return picks


def check_sums(family, cfg, requests, counter) -> list[int]:
    """Each MoE layer's picks are its weighted tokens x top-k: every token fed, or in the last layer of most families
    the tokens whose logits came back; dense layers have none. Only counted steps read nodes, one per MoE layer
    and micro-batch (llama.cpp makes one per sequence of a prompts' step). The MoE layers, in order."""
    counts, tokens = counter.snapshot()
    assert counter.errors == 0
    weights = [position_weights(len(r.prompt_ids), NEW_TOKENS - 1) for r in requests]  # the last token is never fed
    fed = sum(map(sum, weights))
    outputs = sum(sum(w[len(r.prompt_ids) - 1:]) for r, w in zip(requests, weights))  # from the last prompt token
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    last = cfg.num_layers - 1
    assert moe and last in moe
    expected = [(outputs if i == last and family not in WHOLE_LAST_LAYER else fed) if i in moe else 0
                for i in range(cfg.num_layers)]
    assert tokens.tolist() == expected, family
    assert counts.sum(axis=1).tolist() == [n * cfg.num_experts_per_tok for n in expected], family
    # the prompts' step and decode steps 0, 2, 4 of 5 counted; the skipped ones asked the callback for nothing
    counted = 1 + len(range(0, NEW_TOKENS - 1, COUNT_EVERY))
    assert (counter.steps, counter.counted_steps) == (1 + NEW_TOKENS - 1, counted)
    steps = reads_per_step(counter)
    assert all(reads == 0 for weight, reads in steps if weight == 0), (family, steps)
    assert all(reads > 0 and reads % len(moe) == 0 for weight, reads in steps if weight), (family, steps)
    return moe


def run_prompts(engine):
    from moedesk.engine.requests import Request, SamplingParams

    requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0,
                                                                  ignore_eos=True)) for p in PROMPTS]
    return requests, engine.complete(requests)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(COMPARED)))
@pytest.mark.usefixtures("one_torch_thread")
def test_counts_add_up_to_tokens_times_top_k_on_the_other_families(family, tmp_path):
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(build(family, tmp_path / family).gguf), engine="llama.cpp", context_length=128)
    try:
        requests, _ = run_prompts(engine)
        check_sums(family, engine.config, requests, engine.llama.counter)
    finally:
        engine.close()


@pytest.mark.parametrize("family", COMPARED)
@pytest.mark.usefixtures("one_torch_thread")
def test_counts_are_the_routers_picks_as_transformers_makes_them(family, tmp_path):
    from moedesk.engine.runtime import Engine

    built = build(family, tmp_path / family)
    # The CPU's arithmetic, as transformers' here (a CUDA build would put every layer on the GPU by default: the
    # GPU's test is below)
    engine = Engine.load(str(built.gguf), engine="llama.cpp", device="cpu", context_length=128)
    try:
        cfg = engine.config
        counter = engine.llama.counter
        assert counter is not None and counter.native  # the C callback (gcc is on every machine that runs this)
        requests, done = run_prompts(engine)
        counts, _ = counter.snapshot()
        moe = check_sums(family, cfg, requests, counter)
        whole = family in WHOLE_LAST_LAYER
        sequences = [(r.prompt_ids + c.token_ids[:-1], position_weights(len(r.prompt_ids), len(c.token_ids) - 1),
                      0 if whole else len(r.prompt_ids) - 1)
                     for r, c in zip(requests, done)]
        reference = transformers_picks(built.model, sequences, cfg.num_layers, cfg.num_experts)
        assert counts.tolist() == reference.tolist(), family

        on_gpu, popularity = engine.expert_map()  # what the heat map shows: the MoE layers' rows
        assert popularity == [counts[i].tolist() for i in moe] and len(on_gpu) == len(moe)
        stats = engine.expert_stats()
        assert stats["expert_counts"] and stats["experts_cpu"] == int(counts.sum()) and stats["experts_gpu"] == 0
        assert stats["count_every"] == COUNT_EVERY  # what the heat map's legend says
    finally:
        engine.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_counting_switches_off_and_on_and_the_python_callback_counts_alike(tmp_path):
    """Off: no callback in the context (it costs speed) and zeros in the map. On again: counting from zero. The
    Python callback (where no C compiler is found) counts what the C one counts."""
    from moedesk.engine.llamacpp.expert_counts import ExpertCounter
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    built = build("qwen3moe", tmp_path / "q")
    engine = Engine.load(str(built.gguf), engine="llama.cpp", context_length=128, count_experts=False)
    request = Request(engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0,
                                                                         ignore_eos=True))
    try:
        assert engine.llama.counter is None
        off = engine.complete([request])[0]
        assert not any(map(any, engine.expert_map()[1]))
        assert engine.expert_stats()["expert_counts"] is False and "gpu_hit_rate" not in engine.expert_stats()

        assert engine.count_experts(True)
        on = engine.complete([request])[0]
        assert on.token_ids == off.token_ids  # counting changes nothing of the reply
        native, _ = engine.llama.counter.snapshot()
        native_reads = engine.llama.counter.reads
        assert native.sum() > 0 and 0 < engine.llama.counter.counted_steps < engine.llama.counter.steps

        def python_counter():
            engine.llama.counter = ExpertCounter(engine.api, library().ggml, engine.config.num_layers,
                                                 engine.config.num_experts, native=False)
            engine.llama.resize(engine.llama.slots)

        assert engine.scheduler.when_idle(python_counter)
        assert not engine.llama.counter.native
        assert engine.complete([request])[0].token_ids == off.token_ids
        python, _ = engine.llama.counter.snapshot()
        assert python.tolist() == native.tolist() and engine.llama.counter.errors == 0
        assert engine.llama.counter.reads == native_reads  # it too declines every node on a skipped step
        assert engine.count_experts(False) and engine.llama.counter is None
    finally:
        engine.close()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("native", [True, False], ids=["C", "Python"])
def test_layers_whose_experts_are_on_the_gpu_are_sampled_more_thinly_and_weighed_to_match(native, tmp_path):
    """A counted decode step cuts the GPU split of each layer it reads (and costs ggml-cuda that split's CUDA graph
    for two more steps), so layers marked on the GPU are read one decode step in `gpu_count_every`, each pick
    counted that many times: on a step that counts neither kind no node is read, on each other step one per
    layer of the kinds it counts, and each layer's tokens are the prompt's plus its own steps' weights. The marks
    are what the counter is told; where the layers really are does not change what it reads."""
    from moedesk.engine.llamacpp.expert_counts import ExpertCounter
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(build("qwen3moe", tmp_path / "q").gguf), engine="llama.cpp", context_length=128,
                         count_experts=False)
    layers = engine.config.num_layers
    assert layers >= 3 and all(map(engine.config.is_moe_layer, range(layers)))
    on_gpu = [True] + [False] * (layers - 1)

    def thin():
        engine.llama.counter = ExpertCounter(engine.api, library().ggml, layers, engine.config.num_experts,
                                             native=native, count_every=2, on_gpu=on_gpu, gpu_count_every=3)
        engine.llama.resize(engine.llama.slots)

    try:
        assert engine.scheduler.when_idle(thin)
        prompt = engine.tokenizer.encode(PROMPTS[0])
        engine.complete([Request(prompt, SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True))])
        counter = engine.llama.counter
        assert counter.native == native and counter.errors == 0 and counter.decode_steps >= 6
        steps = reads_per_step(counter)
        assert steps[0] == (1, layers)  # the prompt: every layer, whole
        for step, (weight, reads) in enumerate(steps[1:]):
            assert weight == step_weight(False, step, 2)
            assert reads == (layers - 1) * (step % 2 == 0) + (step % 3 == 0), step
        _, tokens = counter.snapshot()
        decode = range(counter.decode_steps)
        assert tokens[0] == len(prompt) + sum(step_weight(False, s, 3) for s in decode)
        assert tokens[1] == len(prompt) + sum(step_weight(False, s, 2) for s in decode)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("one_torch_thread")
def test_on_the_gpu_the_counts_are_read_from_its_memory(tmp_path, monkeypatch):
    """llama.cpp built with CUDA routes on the GPU: the counter copies the ids back (ggml_backend_tensor_get), and
    they are the CPU's picks but for near-ties in the GPU's arithmetic; with one layer's experts pinned to RAM the
    stats split the picks by where each layer's experts are, and the counter knows which layers' are on the GPU.
    Those are sampled as often as the others here, so that both runs' counts compare."""
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    monkeypatch.setattr(expert_counts, "GPU_COUNT_EVERY", COUNT_EVERY)
    built = build("qwen3moe", tmp_path / "q")
    marks = {}
    counts = {}
    for device in ("cpu", "auto"):
        engine = Engine.load(str(built.gguf), engine="llama.cpp", device=device, context_length=128, cpu_moe=1)
        try:
            assert (engine.device.type == "cuda") == (device == "auto"), " / ".join(engine.warnings)
            requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0,
                                                                          ignore_eos=True)) for p in PROMPTS]
            engine.complete(requests)
            counts[device], _ = engine.llama.counter.snapshot()
            marks[device] = engine.llama.counter.on_gpu.tolist()
            stats = engine.expert_stats()
        finally:
            engine.close()
    gpu, cpu = counts["auto"], counts["cpu"]
    assert gpu.sum(axis=1).tolist() == cpu.sum(axis=1).tolist()
    assert np.minimum(gpu, cpu).sum() >= 0.95 * cpu.sum()
    assert stats["experts_cpu"] == int(gpu[0].sum()) and stats["experts_gpu"] == int(gpu[1:].sum())
    assert marks == {"cpu": [0] * len(gpu), "auto": [0] + [1] * (len(gpu) - 1)}
    assert stats["count_every"] == stats["gpu_count_every"] == COUNT_EVERY


def test_the_picks_are_read_at_the_experts_first_product():
    """Where the experts are in RAM that product is in a CPU split, whose ids are the scheduler's copy of the choice:
    a cut there leaves the GPU's split, and its CUDA graph, whole."""
    from moedesk.engine.llamacpp.expert_counts import ids_layer, reads_picks

    assert ids_layer(b"ffn_moe_topk-3") == 3 and ids_layer(b"CPU#ffn_moe_topk-12#0") == 12
    assert ids_layer(b"CUDA0#ffn_moe_probs-3#0") is None and ids_layer(b"ffn_moe_topk-3#") is None
    assert reads_picks(b"ffn_moe_up-0", b"MUL_MAT_ID") and reads_picks(b"ffn_moe_gate_up-5", b"MUL_MAT_ID")
    assert reads_picks(b"ffn_moe_up_scaled-1", b"MUL_MAT_ID")  # the same product, renamed where it has scales
    assert not reads_picks(b"ffn_moe_up_biased-1", b"ADD_ID") and not reads_picks(b"ffn_moe_up-2", b"VIEW")
    assert not reads_picks(b"ffn_moe_gate-0", b"MUL_MAT_ID") and not reads_picks(b"ffn_moe_down-0", b"MUL_MAT_ID")
    assert not reads_picks(b"ffn_moe_topk-0", b"VIEW")
