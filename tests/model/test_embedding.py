"""The token table kept in host memory beside a GPU (engine.model.embedding): which models keep it there, and every
size that counts the GPU's bytes leaving it out (the budget's floor, the loaded model's, the Models screen's)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.embedding import ENV, table_bytes, table_in_host, table_stays_in_host
from moedesk.engine.model.transformer import Transformer
from moedesk.engine.offload.gpu_budget import model_split, non_expert_bytes
from moedesk.engine.runtime import held_bytes


def test_moe_models_with_their_own_head_keep_the_table_in_host(monkeypatch):
    moe = shape_config("tiny-moe")
    assert table_stays_in_host(moe)
    assert not table_stays_in_host(replace(moe, tie_word_embeddings=True))  # the head reads the whole table
    assert not table_stays_in_host(replace(moe, num_experts=0, moe_layers=(False,) * 4))
    assert not table_in_host(moe, "cpu")  # nothing to gain without a GPU
    monkeypatch.setenv(ENV, "1")
    assert not table_stays_in_host(moe)


def test_lookups_land_on_the_home_device_wherever_the_table_lies():
    model = Transformer(shape_config("tiny-moe"), 16)
    embed = model.embed
    assert embed.device == embed.weight.device and not embed.in_host
    embed.home = torch.device("cuda")  # as keep_in_host leaves it (the table then pinned)
    assert embed.device == torch.device("cuda") and embed.in_host
    tokens = torch.tensor([[1, 5, 511]])
    assert torch.equal(embed(tokens), F.embedding(tokens, embed.weight))  # host tokens: read in place


def test_the_gpu_budget_leaves_a_table_in_host_out():
    cfg = shape_config("qwen3-30b-a3b", 48)
    table = table_bytes(cfg, 2)
    assert table == 151936 * 2048 * 2
    assert non_expert_bytes(cfg, 2) - non_expert_bytes(cfg, 2, table_in_host=True) == table
    on_gpu = model_split(cfg, 8 * 2**30, 4096, 2, 512)
    in_host = model_split(cfg, 8 * 2**30, 4096, 2, 512, table_in_host=True)
    assert on_gpu.weights - in_host.weights == table and in_host.experts - on_gpu.experts == table


def test_held_bytes_leave_a_table_in_host_out():
    model = Transformer(shape_config("tiny-moe"), 16)
    before = held_bytes(model)
    model.embed.home = torch.device("cuda")
    assert before - held_bytes(model) == model.embed.weight.numel() * model.embed.weight.element_size()


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_the_models_screen_counts_the_table_in_ram(tiny_checkpoint, arch):
    from moedesk.app.tui.catalog import estimate_line
    from moedesk.engine.load.size_estimate import summarize_path

    weights = summarize_path(tiny_checkpoint(arch))
    estimate = weights.estimate("auto", "bfloat16")
    cfg = weights.config
    assert estimate.table_bytes == cfg.vocab_size * cfg.hidden_size * 2
    assert estimate.ram_bytes(True) == estimate.expert_bytes + estimate.table_bytes
    assert estimate.gpu_bytes(True) == estimate.other_bytes - estimate.table_bytes
    assert estimate.ram_bytes(False) == estimate.total_bytes  # without a GPU everything is in RAM anyway
    assert "token table" in estimate_line(estimate, True, str)
    assert "token table" not in estimate_line(estimate, False, str)  # all of it in RAM: nothing to say


def test_a_table_off_the_gpu_is_copied_for_a_head_there_only_where_it_must():
    from moedesk.engine.model.embedding import rows, shared_table

    table = torch.randn(32, 8)
    assert shared_table(table, "cpu", torch.float32) is table
    assert shared_table(table, "cpu", torch.bfloat16).dtype == torch.bfloat16
    tokens = torch.tensor([[0, 31, 4]])
    assert torch.equal(rows(table, tokens), F.embedding(tokens, table))


@pytest.mark.gpu
def test_a_pinned_table_is_shared_with_a_head_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from moedesk.engine.model.embedding import rows, shared_table

    table = torch.randn(32, 8, dtype=torch.bfloat16).pin_memory()
    assert shared_table(table, "cuda", torch.bfloat16) is table  # no copy of the table on the GPU
    assert shared_table(table, "cuda", torch.float32).is_cuda  # another dtype: a copy
    tokens = torch.tensor([[0, 31, 4]], device="cuda")
    assert torch.equal(rows(table, tokens).cpu(), F.embedding(tokens.cpu(), table))


def test_the_engine_says_how_much_of_the_table_stays_in_ram(tiny_checkpoint):
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32", context_length=64)
    assert engine.table_in_ram_bytes == 0  # without a GPU the CPU holds it with everything else
    weight = engine.model.embed.weight
    engine.model.embed.home = torch.device("cuda")  # as keep_in_host leaves it beside a GPU
    assert engine.table_in_ram_bytes == weight.numel() * 4
