"""A GGUF's packed non-expert weights stay packed (engine.model.packed_linear): on a GPU and on a CPU with the native
packed kernel by default, anywhere with MOEDESK_PACKED_WEIGHTS=1, nowhere with MOEDESK_PACKED_WEIGHTS=0.

The files are llama.cpp's own quantisations of a float32 Mixtral-style GGUF (tests/load/test_packed_experts.py):
Q4_K_M mixes q4_k projections with q6_k ones (attn_v, the head), Q8_0 is q8_0 throughout; the embedding table stays
16-bit either way. On the CPU without the kernel (MOEDESK_NO_NATIVE_KERNELS=1) a PackedLinear dequantises its rows
exactly as the gguf package does at a plain load, so packing changes no weight: greedy ids are equal and the logits
equal to float32 summation order. With the kernel, x is quantised to int8 per 32 values as for the experts (and as
llama.cpp does): the logits stay within that arithmetic's tolerance of the plain load's."""
from __future__ import annotations

import pytest
import torch

from moedesk.engine.model.packed_linear import PackedLinear
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.kernels import cpu_quant
from moedesk.kernels.quant_formats import FORMATS
from tests.load.test_packed_experts import TEXT, quantised, teacher_forced_logits  # noqa: F401 -- the fixture

pytest.importorskip("llama_cpp")
pytest.importorskip("triton", reason="PackedLinear's module imports the GPU kernels' module")

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def packed_modules(engine) -> dict[str, PackedLinear]:
    return {name: m for name, m in engine.model.named_modules() if isinstance(m, PackedLinear)}


def greedy(engine, ids):
    return engine.complete([Request(ids, GREEDY)])[0].token_ids


@pytest.mark.parametrize("arch,kind,formats", [("llama", "q4_k_m", {"q4_k", "q6_k"}), ("llama", "q8_0", {"q8_0"}),
                                               ("qwen3moe", "q4_k_m", {"q4_k", "q6_k"})])
def test_packed_weights_give_the_same_greedy_ids(quantised, monkeypatch, arch, kind, formats):
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # the dequantising route, exact
    path = str(quantised(arch, kind))
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    plain = Engine.load(path, device="cpu", dtype="float32")
    assert not packed_modules(plain)
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "1")
    packed = Engine.load(path, device="cpu", dtype="float32")
    modules = packed_modules(packed)
    layers = packed.config.num_layers
    # every attention projection and the head; not the embedding table nor the routers
    assert set(modules) == {f"layers.{i}.attn.{p}" for i in range(layers) for p in ("wq", "wk", "wv", "wo")} | {
        "lm_head"}, sorted(modules)
    assert {m.fmt for m in modules.values()} == formats
    assert packed.model.embed.weight.dtype == torch.float32 and packed.model.layers[0].moe.router.weight.is_floating_point()
    for name, m in modules.items():
        dense = plain.model.get_submodule(name).weight
        assert torch.equal(m.weight, dense), name  # llama's q/k rows un-permuted as the floats are

    ids = plain.tokenizer.encode(TEXT)
    exact, ours = teacher_forced_logits(plain, ids), teacher_forced_logits(packed, ids)
    assert (ours - exact).abs().max() <= 1e-4 * exact.std()
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert greedy(packed, ids[:8]) == greedy(plain, ids[:8])


@pytest.mark.skipif(not cpu_quant.available(), reason="the native packed kernel is not built for this CPU")
@pytest.mark.parametrize("arch,kind", [("llama", "q4_k_m"), ("llama", "q8_0"), ("qwen3moe", "q4_k_m")])
def test_cpu_load_computes_packed_weights_in_native_calls(quantised, monkeypatch, arch, kind):
    """By default a CPU load keeps them packed and computes each in one native call, never dequantising them (which
    a step would pay for every weight): within the int8 tolerance of the float32 load (test_packed_experts' bounds,
    in units of the logits' spread: mean error 1%, none over 6%), and agreeing with llama.cpp's top-1 as closely."""
    from moedesk.engine.model.packed_linear import ENV
    from tests.load.test_packed_experts import counted_native_calls, llama_cpp_logits

    path = str(quantised(arch, kind))
    monkeypatch.setenv(ENV, "0")
    plain = Engine.load(path, device="cpu", dtype="float32")
    monkeypatch.delenv(ENV)
    packed = Engine.load(path, device="cpu", dtype="float32")
    modules = packed_modules(packed)
    assert "lm_head" in modules and len(modules) == 4 * packed.config.num_layers + 1
    calls = counted_native_calls(monkeypatch, "linear", PackedLinear, "_dequantised",
                                 "a packed weight was dequantised on the CPU")
    ids = plain.tokenizer.encode(TEXT)
    ours, exact = teacher_forced_logits(packed, ids), teacher_forced_logits(plain, ids)
    assert len(calls) == len(modules)
    error = (ours - exact).abs() / exact.std()
    print(f"{arch} {kind}: mean error {error.mean():.4f}, max {error.max():.4f} of the logits' spread")
    assert error.mean() <= 0.01 and error.max() <= 0.06, (error.mean(), error.max())
    theirs = llama_cpp_logits(path, ids)
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"{arch} {kind}: top-1 agreement with llama.cpp {agreement:.3f} over {len(ids)} positions")
    assert agreement >= 0.85, agreement
    assert greedy(packed, ids[:8]) == greedy(packed, ids[:8])  # decode runs, and twice alike


@pytest.mark.parametrize("arch,kind", [("llama", "q4_k_m"), ("qwen3moe", "q4_k_m"), ("llama", "q8_0")])
@pytest.mark.parametrize("setting", [None, "0"])
def test_the_estimate_from_the_header_is_what_a_cpu_load_holds(quantised, monkeypatch, arch, kind, setting):
    """The Models screen's estimate (and the RAM check before reading weights) counts the non-expert weights as the
    load keeps them: packed where it keeps them packed (on the CPU by default where the kernel runs), else float32."""
    from moedesk.engine.load.size_estimate import summarize_path
    from moedesk.engine.model.packed_linear import ENV

    if setting is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, setting)
    path = quantised(arch, kind)
    engine = Engine.load(str(path), device="cpu", dtype="float32")
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters()) + sum(
        m.packed.nbytes for m in packed_modules(engine).values())
    estimate = summarize_path(path).estimate("auto", "float32")
    assert bool(packed_modules(engine)) == (setting is None and cpu_quant.available())
    assert estimate.other_bytes == held
    assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())


def test_packed_rows_are_the_files_bytes(quantised):
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(quantised("llama", "q8_0"))
    rows = checkpoint.read_packed_rows("model.layers.0.self_attn.v_proj.weight")
    assert rows.dtype == torch.uint8 and rows.shape[1] == FORMATS["q8_0"].row_bytes(256)
    assert checkpoint.read_packed_rows("model.embed_tokens.weight") is not None  # packed; the loader keeps it 16-bit
    assert checkpoint.read_packed_rows("model.layers.0.input_layernorm.weight") is None  # float32
    assert checkpoint.read_packed_rows("model.layers.0.block_sparse_moe.experts.0.w1.weight") is None  # an expert
    checkpoint.close()


def test_fused_packed_projections_compute_the_same(quantised, monkeypatch):
    """On CUDA the loader fuses q, k and v (Attention.fuse_projections); packed ones of one format join their rows,
    the parts' buffers becoming views of them (held once). Fused here on the CPU by hand, as test_forward_seam does."""
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "1")
    engine = Engine.load(str(quantised("llama", "q8_0")), device="cpu", dtype="float32")
    ids = engine.tokenizer.encode(TEXT)[:16]
    before = teacher_forced_logits(engine, ids)
    for block in engine.model.layers:
        block.attn.fuse_projections()
    attn = engine.model.layers[0].attn
    assert isinstance(attn.qkv_packed, PackedLinear) and "qkv_packed" not in dict(attn.named_modules())
    assert attn.wk.packed.data_ptr() == attn.qkv_packed.packed[attn.qkv_sizes[0]:].data_ptr()
    fused = teacher_forced_logits(engine, ids)
    assert (fused - before).abs().max() <= 1e-4 * before.std()
    attn.qkv_packed.packed.zero_()  # the forward reads the joined rows: zero weights change the logits
    assert not torch.equal(teacher_forced_logits(engine, ids), fused)


def test_spread_layers_keep_their_packed_weights(quantised, monkeypatch):
    """engine.model.layer_devices moves blocks whose weights are packed buffers, and leaves a packed head alone
    (the CPU twice stands for two GPUs)."""
    from moedesk.engine.model.layer_devices import spread_model

    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "1")
    engine = Engine.load(str(quantised("llama", "q4_k_m")), device="cpu", dtype="float32")
    ids = engine.tokenizer.encode(TEXT)[:16]
    before = teacher_forced_logits(engine, ids)
    spread_model(engine.model, ["cpu", "cpu"], [0, 1])
    assert isinstance(engine.model.lm_head, PackedLinear)
    cache = engine.model.new_cache(1, len(ids), engine.dtype, "cpu")  # a part per device's run of layers
    logits = engine.model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache, engine.executor)[0]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("setting,device,kernel,expected", [
    (None, "cuda", True, True), (None, "cuda:1", False, True), (None, "cpu", True, True), (None, "cpu", False, False),
    ("0", "cuda", True, False), ("0", "cpu", True, False), ("1", "cpu", False, True)])
def test_packed_weights_are_wanted_on_a_gpu_and_a_cpu_with_the_kernel(monkeypatch, setting, device, kernel, expected):
    from moedesk.engine.model.packed_linear import ENV, wanted
    from moedesk.kernels import cpu_quant

    if kernel and not cpu_quant.available():
        pytest.skip(f"the packed CPU kernel is not here: {cpu_quant.unavailable_reason()}")
    if not kernel:
        monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    if setting is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, setting)
    assert wanted(torch.device(device)) is expected


def test_packed_savings_by_layer_and_head():
    from moedesk.engine.memory_fit import packed_savings

    plan = {"layers.1.attn.wq.weight": ("q8_0", 64, 256), "layers.1.attn.wo.weight": ("q4_0", 8, 64),
            "lm_head.weight": ("q4_k", 10, 256)}
    # 16-bit rows of 256 weights are 512 bytes: q8_0's 272, q4_k's 144; q4_0's 64 weights 36 bytes against 128
    assert packed_savings(plan, 2) == {1: 64 * (512 - 272) + 8 * (128 - 36), "head": 10 * (512 - 144)}
    assert packed_savings(None, 2) == {}


def test_budget_counts_the_packed_bytes(quantised, monkeypatch):
    """The plan made from the file before reading a weight is what the load keeps packed; the budget's weights figure,
    early (from the config) and once loaded (the model's own tensors), drops by what those weights save packed."""
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
    from moedesk.engine.load.loader import packed_plan
    from moedesk.engine.memory_fit import packed_savings
    from moedesk.engine.model.packed_linear import plan_of
    from moedesk.engine.offload.devices import layer_sizes
    from moedesk.engine.offload.gpu_budget import non_expert_bytes
    from moedesk.engine.runtime import held_bytes

    path = quantised("llama", "q4_k_m")
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    plain = Engine.load(str(path), device="cpu", dtype="float32")
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "1")
    packed = Engine.load(str(path), device="cpu", dtype="float32")
    cfg, plan = packed.config, plan_of(packed.model)
    checkpoint = GGUFCheckpoint(path)
    assert packed_plan(checkpoint, cfg) == plan
    checkpoint.close()

    saved = packed_savings(plan, 4)  # float32 on the CPU
    assert sum(saved.values()) > 0 and set(saved) == {0, 1, "head"}
    assert held_bytes(plain.model) - held_bytes(packed.model) == sum(saved.values())
    whole = 2 ** 40
    assert plain.gpu_budget_split(whole).weights - packed.gpu_budget_split(whole).weights == sum(saved.values())
    # early figures, from the config: bf16's 2 bytes a weight against q4_k's 4.5 and q6_k's 6.56 bits
    assert non_expert_bytes(cfg, 2) - non_expert_bytes(cfg, 2, plan) == sum(packed_savings(plan, 2).values())
    weights, _, _, _, head = layer_sizes(cfg, 2, 16, 2, plan)
    plain_weights, _, _, _, plain_head = layer_sizes(cfg, 2, 16, 2)
    assert [a - b for a, b in zip(plain_weights, weights)] == [packed_savings(plan, 2)[i] for i in range(2)]
    assert plain_head - head == packed_savings(plan, 2)["head"]
    ratio = sum(rows * FORMATS[fmt].row_bytes(k) for fmt, rows, k in plan.values()) / sum(
        rows * k * 2 for _, rows, k in plan.values())
    assert 4.5 / 16 <= ratio <= 6.6 / 16  # q4_k rows with q6_k ones (attn_v, the head)


def test_held_bytes_counts_fused_views_once(quantised):
    from moedesk.engine.runtime import held_bytes

    engine = Engine.load(str(quantised("llama", "q8_0")), device="cpu", dtype="float32")
    assert packed_modules(engine) or not cpu_quant.available()  # packed, where the CPU kernel computes them
    before = held_bytes(engine.model)
    for block in engine.model.layers:
        block.attn.fuse_projections()  # q, k and v become views of one fused weight (a buffer)
    assert held_bytes(engine.model) == before


@pytest.mark.parametrize("shape,fmt,packed_as", [("tiny-moe", "q8_0", {"q8_0"}), ("tiny-glm", "q4_0", {"q4_0"}),
                                                 ("tiny-moe", "q4_k", {"q4_0"}),  # 64 columns: q4_k's fallback
                                                 ("tiny-moe", "mxfp4", {"q8_0"})])  # as llama.cpp's MXFP4_MOE
def test_synthetic_models_pack_their_non_expert_weights(shape, fmt, packed_as, monkeypatch):
    """The benchmarks' random models (`moedesk bench`, profile_gpu_decode.py) with the flag and packed experts: the
    weights a GGUF of that quantisation keeps packed are packed, and the bench's budget counts them packed."""
    from moedesk.bench.budget import bench_split
    from moedesk.engine.load.synthetic import SHAPES, packed_plan, synthetic_model
    from moedesk.engine.memory_fit import packed_savings
    from moedesk.engine.model.packed_linear import plan_of
    from moedesk.engine.offload.expert_executor import LocalExecutor

    cfg = SHAPES[shape]
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=64, expert_format=fmt,
                               packed_weights=True)
    plan = plan_of(model)
    assert plan == packed_plan(cfg, fmt, True) and {f for f, _, _ in plan.values()} == packed_as
    assert "lm_head.weight" in plan and "layers.0.attn.wq.weight" in plan and "embed.weight" not in plan
    assert not any(name.endswith("router.weight") for name in plan)
    if shape == "tiny-glm":  # the dense first layer's MLP and the shared experts
        assert "layers.0.mlp.down.weight" in plan and "layers.1.moe.shared.up.weight" in plan
    cache = model.new_cache(1, 12, torch.float32, "cpu")
    logits = model(torch.arange(12)[None], torch.arange(12)[None], cache, LocalExecutor())
    assert torch.isfinite(logits).all()
    assert packed_plan(cfg, fmt, False) == {} and packed_plan(cfg, "dense", True) == {}

    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    plain = bench_split(cfg, 2 ** 40, 64, torch.float32, 16, fmt).weights
    monkeypatch.delenv("MOEDESK_PACKED_WEIGHTS")  # the bench's budget is a GPU's: packed by default
    assert plain - bench_split(cfg, 2 ** 40, 64, torch.float32, 16, fmt).weights == sum(
        packed_savings(plan, 4).values())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4_k_m", "q8_0"])
def test_packed_weights_on_cuda_stay_close_to_16_bit(quantised, monkeypatch, kind):
    """On the GPU the packed weights are read by the packed kernel (decode's rows) or dequantised for cuBLAS (a
    prompt's): exact weights against the 16-bit load's bf16-rounded ones, both with bf16 activations, so the logits
    differ by a few bf16 steps. q/k/v of one format (q8_0) are fused into one packed launch."""
    path = str(quantised("llama", kind))
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    plain = Engine.load(path, device="cuda", dtype="bfloat16", offload=False)
    assert not packed_modules(plain)
    monkeypatch.delenv("MOEDESK_PACKED_WEIGHTS")  # on by default on a GPU
    packed = Engine.load(path, device="cuda", dtype="bfloat16", offload=False)
    assert packed_modules(packed) and all(m.packed.is_cuda for m in packed_modules(packed).values())
    assert ("qkv_packed" in packed.model.layers[0].attn.__dict__) == (kind == "q8_0")
    ids = plain.tokenizer.encode(TEXT)
    exact, ours = teacher_forced_logits(plain, ids), teacher_forced_logits(packed, ids)
    assert (ours - exact).abs().max() <= 0.05 * exact.std(), (ours - exact).abs().max() / exact.std()
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    assert greedy(packed, ids[:8]) == greedy(packed, ids[:8])  # decode (CUDA graphs) runs, and twice alike
    held = packed.gpu_budget_split(2 ** 40).weights
    assert held < plain.gpu_budget_split(2 ** 40).weights


def test_the_check_before_reading_counts_the_weights_packed(quantised, monkeypatch):
    """A GPU budget that holds the weights packed but not in 16 bits: refused before reading a weight (auto then
    takes llama.cpp) without the flag, accepted with it."""
    from moedesk.engine.generation.scheduler import default_prefill_chunk
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
    from moedesk.engine.load.loader import packed_plan
    from moedesk.engine.model.architectures import parse_config
    from moedesk.engine.offload.gpu_budget import GIB, budget_holding, model_split
    from moedesk.engine.runtime import UnreadBudgetError, _check_gpu_holds_weights

    checkpoint = GGUFCheckpoint(quantised("llama", "q4_k_m"))
    cfg = parse_config(checkpoint.config, checkpoint.path, tensors=checkpoint.shapes())
    context, piece = 256, default_prefill_chunk(torch.device("cpu"))
    packed = model_split(cfg, 2 ** 62, context, 2, piece, packed=packed_plan(checkpoint, cfg))
    plain = model_split(cfg, 2 ** 62, context, 2, piece)
    budget = budget_holding(packed.weights + packed.kv_cache + packed.workspace, 0) + 64
    assert budget < budget_holding(plain.weights + plain.kv_cache + plain.workspace, 0)

    def check():
        _check_gpu_holds_weights(checkpoint, budget / GIB, torch.device("cpu"), torch.bfloat16, context)

    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    with pytest.raises(UnreadBudgetError):
        check()
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "1")
    check()
    checkpoint.close()


@pytest.mark.skipif(not cpu_quant.available(), reason="the native packed kernel is not built for this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_cpu_load_decodes_attention_on_the_native_pool(quantised, monkeypatch, arch):
    """A packed CPU load's decode steps take their attention from kernels/cpu_attention.py, over the cache in place:
    every layer of every step, and the logits those of torch's attention over the cache read out, to float32
    summation order. A float32 load (no packed weights) keeps torch's, the reference's arithmetic."""
    from moedesk.engine.generation.runner import pool_decode
    from moedesk.kernels import cpu_attention

    if not cpu_attention.available():
        pytest.skip(cpu_attention.unavailable_reason())
    engine = Engine.load(str(quantised(arch, "q4_k_m")), device="cpu", dtype="float32")
    assert pool_decode(engine.model)  # so a step stays on one torch thread at any depth (runner.cores_for)
    model, ids = engine.model, torch.tensor([(engine.tokenizer.encode(TEXT) * 3)[:24]])
    calls = []
    kernel = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or kernel(*a))

    def steps():
        cache = model.new_cache(1, 32, torch.float32, "cpu")
        positions = torch.arange(24).unsqueeze(0)
        model(ids[:, :16], positions[:, :16], cache, engine.executor)
        return torch.cat([model(ids[:, t:t + 1], positions[:, t:t + 1], cache, engine.executor)[:, -1]
                          for t in range(16, 24)])

    ours = steps()
    assert len(calls) == 8 * engine.config.num_layers
    monkeypatch.setattr(cpu_attention, "applies", lambda *a: False)
    theirs = steps()
    assert len(calls) == 8 * engine.config.num_layers  # none more: torch's attention
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.std(), (ours - theirs).abs().max()
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    assert not pool_decode(Engine.load(str(quantised(arch, "q4_k_m")), device="cpu", dtype="float32").model)
