"""`moedesk bench --gpu-budget` is the whole GPU's, split as a user's named budget is (bench.budget)."""
import pytest
import torch

from moedesk.app.cli import main
from moedesk.bench.budget import bench_split, budget_for_experts, expert_bytes, layers_in_ram, planned_experts
from moedesk.bench.synthetic import bench_context, run_bench
from moedesk.engine.generation.scheduler import PREFILL_CHUNK_GPU
from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.embedding import table_in_host
from moedesk.engine.offload.gpu_budget import ContextBudgetError, prefill_workspace_bytes
from moedesk.kernels import cpu_quant

GIB = 2**30


def test_whole_mixtral_at_16_gib_keeps_what_weights_cache_and_workspace_leave():
    """Mixtral-8x7B's published architecture counted by hand: 4096 hidden, 32 layers, 32 query and 8 key/value heads
    of 128, 8 experts of 14336, a 32000-token vocabulary with its own head (46.7B parameters in all)."""
    cfg = shape_config("mixtral-8x7b")
    context = bench_context()  # prefill 2048 then 64 decoded tokens
    assert context == 2112
    split = bench_split(cfg, 16 * GIB, context, torch.bfloat16, PREFILL_CHUNK_GPU)
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 4096 + 2 * 4096  # q, o; k, v; router; two norms
    non_expert = 2 * 32000 * 4096 + 32 * per_layer + 4096
    assert non_expert + 32 * 8 * 3 * 4096 * 14336 == pytest.approx(46.7e9, rel=1e-3)
    rotary = 2 * context * 128 * 4  # cos and sin in float32
    table = 2 * 32000 * 4096 * table_in_host(cfg, "cuda")  # beside a GPU the token table stays in RAM
    assert table
    assert split.weights == 2 * non_expert + rotary - table
    assert split.kv_cache == context * 32 * 2 * 8 * 128 * 2
    assert split.workspace == prefill_workspace_bytes(cfg, 2048, context, 2)
    assert split.slack == int(0.05 * 16 * GIB)
    assert split.weights + split.kv_cache + split.workspace + split.slack + split.experts == 16 * GIB
    q4_k = expert_bytes(cfg, "q4_k", torch.bfloat16)
    assert q4_k == 3 * 4096 * 14336 // 256 * 144  # 144 bytes a block of 256 weights
    # Experts only, 16 GiB would hold 173 of them; the rest of the GPU's needs take 46.
    assert (16 * GIB) // q4_k == 173
    assert planned_experts(split, q4_k, cfg) == 127


def test_the_planned_experts_shrink_with_the_context_and_a_budget_too_small_is_refused():
    cfg = shape_config("qwen3-30b-a3b")  # the whole 48 layers, the 8 GiB target of issue 42
    one = expert_bytes(cfg, "q4_k", torch.bfloat16)
    counts = [planned_experts(bench_split(cfg, 8 * GIB, n, torch.bfloat16, PREFILL_CHUNK_GPU), one, cfg)
              for n in (2112, 8192 + 577, 32768 + 577)]
    assert 0 < counts[2] < counts[1] < counts[0] < (8 * GIB) // one
    with pytest.raises(ContextBudgetError, match="use a context of at most"):
        bench_split(cfg, 4 * GIB, 32768 + 577, torch.bfloat16, PREFILL_CHUNK_GPU)
    every = planned_experts(bench_split(cfg, 200 * GIB, 2112, torch.bfloat16, PREFILL_CHUNK_GPU), one, cfg)
    assert every == 48 * 128  # never more than the model has


def test_the_bench_split_is_a_loaded_models_split(tiny_checkpoint):
    """The bench's sizes, taken from its model made on the meta device, are what Engine counts of a loaded model of
    the same config: the same budget keeps the same bytes for experts."""
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", offload=True, gpu_budget=0,
                         context_length=300)
    budget = 4 * 2**20
    theirs = engine.gpu_budget_split(budget)
    mine = bench_split(engine.config, budget, engine.context_length, torch.float32,
                       engine.scheduler.prefill_chunk or engine.context_length, device="cpu")
    assert mine == theirs


def test_bench_places_what_the_split_leaves_at_its_context(capsys):
    cfg = shape_config("tiny-moe", 2)
    context = bench_context((16,), 6)
    budget = budget_for_experts(cfg, 5, context, "dense", "cpu")
    said = []
    report = run_bench("tiny-moe", 2, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=1, log=said.append)
    # The profile takes minutes on a busy CPU: a line says so before it starts, not only after.
    assert said[0].startswith("built tiny-moe") and said[1].startswith("profiling one expert's latency")
    assert report["experts_on_gpu"] == 5  # the same budget for experts alone would hold all 16
    assert int(budget * GIB) // expert_bytes(cfg, "dense", torch.float32) >= 16
    split = report["budget_split_bytes"]
    assert sum(split.values()) == int(budget * GIB) and split["kv_cache"] > 0 and split["weights"] > 0


def test_a_budget_too_small_is_refused_in_one_line_before_the_model_is_built(monkeypatch, capsys):
    from moedesk.engine.load import synthetic

    monkeypatch.setattr(synthetic, "synthetic_model", lambda *a, **k: pytest.fail("built before the budget's check"))
    assert main(["bench", "--shape", "tiny-moe", "--layers", "2", "--device", "cpu", "--gpu-budget", "0.0002"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "GPU budget cannot hold the weights" in line and "--gpu-budget" in line


def test_llamacpp_keeps_in_ram_the_layers_whose_whole_experts_the_split_leaves_no_room_for(monkeypatch):
    """-ncmoe for llama.cpp at the bench's budget: 124 Mixtral experts at 16 GiB with 16-bit non-expert weights
    (above) are 15 whole layers of 8, so 17 of 32 layers keep their experts in RAM. Packed in q4_k, as on a GPU by
    default, attention and head save 1.4375 bytes a weight of their 1.47G: 2.1 GB, 21 experts of 99 MB more, 145 in
    18 whole layers, so 14 stay in RAM. A bigger budget keeps fewer there, none when all fit."""
    cfg = shape_config("mixtral-8x7b")
    monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", "0")
    assert layers_in_ram(cfg, 16, bench_context(), "q4_k") == 32 - 124 // 8
    on_cpu = layers_in_ram(cfg, 16, bench_context(), "q4_k", device="cpu")  # float32 there
    monkeypatch.delenv("MOEDESK_PACKED_WEIGHTS")
    assert layers_in_ram(cfg, 16, bench_context(), "q4_k") == 32 - 145 // 8
    packed_cpu = layers_in_ram(cfg, 16, bench_context(), "q4_k", device="cpu")  # packed where the CPU kernel runs
    assert packed_cpu < on_cpu if cpu_quant.available() else packed_cpu == on_cpu
    assert layers_in_ram(cfg, 24, bench_context(), "q4_k") < layers_in_ram(cfg, 16, bench_context(), "q4_k")
    assert layers_in_ram(cfg, 1000, bench_context(), "q4_k") == 0
    # A longer context's cache takes room from the experts: more layers stay in RAM.
    assert layers_in_ram(cfg, 16, 32768, "q4_k") > layers_in_ram(cfg, 16, bench_context(), "q4_k")
