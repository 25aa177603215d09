"""The model forward a draft tree and an EAGLE head need: hidden states out (against transformers' own), and a
caller's mask, positions and cache slots in (a tree verified in one pass equals each branch run alone)."""
import pytest
import torch

from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.runtime import Engine
from tests.model.forward_checks import assert_tree_equals_each_branch, run
from tests.reference import hf_model


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_features_are_transformers_hidden_states(tiny_checkpoint, arch):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    ids = engine.tokenizer.encode("the quick brown fox jumps over")
    layers = engine.config.num_layers
    cache = KVCache(engine.config, rows=1, length=32, dtype=torch.float32, device="cpu")
    logits, hidden = run(engine, cache, ids, 0, features=(0, 1, layers - 1, "final"))
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([ids]), output_hidden_states=True)
    # transformers' hidden_states[i] is the input of layer i; its last one is after the final norm.
    for i in (0, 1, layers - 1):
        torch.testing.assert_close(hidden[i], ref.hidden_states[i], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hidden["final"], ref.hidden_states[-1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits, run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_tree_in_one_pass_equals_each_branch_alone(tiny_checkpoint, arch):
    """A draft tree's nodes, given the caller's mask, positions and cache slots, each see the prompt and their
    ancestors only (tests.model.forward_checks)."""
    assert_tree_equals_each_branch(Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # query/key norm; projection biases
def test_fused_projections_compute_what_the_separate_ones_do(tiny_checkpoint, arch):
    """On CUDA the loader fuses wq, wk and wv into one matmul (Attention.fuse_projections); here on the CPU, where
    the loader leaves them apart, fusing by hand must change nothing but the number of matmuls."""
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32")
    model = engine.model
    assert not hasattr(model.layers[0].attn, "qkv_weight")  # not on the CPU
    ids = engine.tokenizer.encode("the quick brown fox jumps over")
    before = run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for block in model.layers:
        block.attn.fuse_projections()
    attn = model.layers[0].attn
    assert attn.wk.weight.data_ptr() == attn.qkv_weight[attn.qkv_sizes[0]:].data_ptr()  # views, not copies
    assert (attn.qkv_bias is not None) == (arch == "qwen2_moe")
    after_state = model.state_dict()
    assert after_state.keys() == state.keys() and all(torch.equal(after_state[k], v) for k, v in state.items())
    after = run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    attn.qkv_weight.zero_()  # the forward reads the fused weight
    assert not torch.allclose(run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0), before)


def test_running_out_of_memory_while_fusing_leaves_the_layers_left_as_they_were(tiny_checkpoint, monkeypatch):
    from moedesk.engine.model import transformer

    engine = Engine.load(str(tiny_checkpoint("qwen2_moe")), device="cpu", dtype="float32")  # biases: two concats
    ids = engine.tokenizer.encode("the quick brown fox jumps over")
    before = run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0)
    concat, calls = torch.cat, []

    def short_of_memory(tensors, *args, **kwargs):
        calls.append(len(tensors))
        if len(calls) == 4:  # the second layer's bias, after its weight
            raise torch.OutOfMemoryError("CUDA out of memory")
        return concat(tensors, *args, **kwargs)

    monkeypatch.setattr(transformer.torch, "cat", short_of_memory)
    blocks = engine.model.layers
    assert transformer.fuse_attention_projections(blocks) == 1
    monkeypatch.setattr(transformer.torch, "cat", concat)
    assert hasattr(blocks[0].attn, "qkv_weight")
    assert not any(hasattr(b.attn, "qkv_weight") or hasattr(b.attn, "qkv_sizes") for b in blocks[1:])
    torch.testing.assert_close(run(engine, KVCache(engine.config, 1, 32, torch.float32, "cpu"), ids, 0), before,
                               atol=1e-5, rtol=1e-5)


def test_attention_mask_is_the_boolean_one_off_cuda():
    from moedesk.engine.model.transformer import ForwardBatch

    batch = ForwardBatch(torch.tensor([[3, 4]]), None, None, kv_len=8)
    assert batch.attention_mask(torch.float32) is batch.mask and batch.mask.dtype == torch.bool


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [7, 32])
def test_attention_mask_on_cuda_is_what_sdpa_makes_of_the_boolean_one(kv_len):
    """Made once a forward: 0 / -inf in the queries' dtype, rows 16-aligned, and the same attention to the bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from moedesk.engine.model.transformer import ForwardBatch, attention

    positions = torch.tensor([[kv_len - 3, kv_len - 2], [1, 2]], device="cuda")
    batch = ForwardBatch(positions, None, None, kv_len=kv_len)
    additive = batch.attention_mask(torch.bfloat16)
    assert additive is batch.attention_mask(torch.bfloat16)  # once a forward
    assert additive.dtype == torch.bfloat16 and additive.stride(-2) % 16 == 0
    assert torch.equal(additive == 0, batch.mask) and bool(additive[~batch.mask].eq(float("-inf")).all())
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, kv_len, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    assert torch.equal(attention(q, k, v, additive, True), attention(q, k, v, batch.mask, True))
