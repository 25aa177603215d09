"""The memory estimate (engine.load.size_estimate) against what loading actually allocates, and against sizes
worked out by hand from the block formats (Q8_0: 34 bytes per 32 weights, Q4_0: 18)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moedesk.engine.errors import UnsupportedModelError
from moedesk.engine.load.checkpoint import open_checkpoint
from moedesk.engine.load.loader import DTYPES, load_model
from moedesk.engine.load.size_estimate import TensorInfo, estimate_memory, summarize, summarize_path
from moedesk.kernels.quant_formats import quantize
from tests.load.test_gguf_checkpoint import spm_vocab

gguf = pytest.importorskip("gguf")


def loaded_bytes(model: str, expert_dtype: str, dtype: str) -> tuple[int, int, set[str]]:
    """(expert stacks' bytes, every other weight's bytes, the stacks' formats) of the model loaded on the CPU."""
    net, _, _ = load_model(open_checkpoint(model), DTYPES[dtype], torch.device("cpu"), expert_dtype=expert_dtype)
    experts = sum(moe.experts.nbytes for moe in net.moe_blocks())
    other = sum(p.numel() * p.element_size() for p in net.parameters())  # a tied embedding counts once
    return experts, other, {moe.experts.describe() for moe in net.moe_blocks()}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "smollm", "glm4_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("expert_dtype", ["auto", "bf16", "int8", "int4"])
def test_estimate_equals_the_loaded_stacks_of_a_16_bit_checkpoint(tiny_checkpoint, arch, expert_dtype):
    folder = tiny_checkpoint(arch)
    weights = summarize_path(folder)
    for dtype in ("float32", "bfloat16"):
        estimate = weights.estimate(expert_dtype, dtype)
        experts, other, formats = loaded_bytes(str(folder), expert_dtype, dtype)
        assert (estimate.expert_bytes, estimate.other_bytes) == (experts, other), (arch, expert_dtype, dtype)
        # Every layer of these holds its experts alike: the stacks' own description, in the estimate's words.
        short = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        assert {f.replace("dense", short).replace(dtype, short) for f in formats} == \
            ({estimate.experts_as} if formats else set())


def test_int4_and_int8_sizes_by_hand_for_mixtral_8x7b():
    """Mixtral-8x7B's shapes, from its tensor list alone (no file): experts 32 layers x 8 x 3 matrices of
    4096 x 14336 weights, in bf16 on disk."""
    H, F, E, L, V = 4096, 14336, 8, 32, 32000
    config = {"model_type": "mixtral", "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": V, "num_local_experts": E,
              "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5}
    tensors = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                        p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (1024, H),
                        p + "self_attn.v_proj.weight": (1024, H), p + "self_attn.o_proj.weight": (H, H),
                        p + "block_sparse_moe.gate.weight": (E, H)})
        for e in range(E):
            for name, shape in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
                tensors[f"{p}block_sparse_moe.experts.{e}.{name}.weight"] = shape
    tensors = {name: TensorInfo(shape, "BF16") for name, shape in tensors.items()}
    expert_weights = L * E * 3 * H * F
    other_weights = 2 * V * H + H + L * (2 * H + 2 * H * H + 2 * 1024 * H + E * H)
    int4 = estimate_memory(config, tensors, "int4", "bfloat16")
    assert int4.expert_bytes == expert_weights // 32 * 18 and int4.other_bytes == other_weights * 2
    assert int4.experts_as == "q4_0"
    assert estimate_memory(config, tensors, "int8", "bfloat16").expert_bytes == expert_weights // 32 * 34
    bf16 = estimate_memory(config, tensors, "auto", "bfloat16")
    assert bf16.expert_bytes == expert_weights * 2 and bf16.experts_as == "bf16"
    # The file is ~93 GB of bf16; as int4 the experts take 28% of their file bytes.
    assert int4.expert_bytes / bf16.expert_bytes == pytest.approx(18 / 64)
    # On a GPU the rest goes there but for the token table (engine.model.embedding); without one it stays in RAM.
    table = V * H * 2
    assert int4.table_bytes == table
    assert int4.ram_bytes(gpu=True) == int4.expert_bytes + table
    assert int4.gpu_bytes(gpu=True) == int4.other_bytes - table
    assert int4.ram_bytes(gpu=False) == int4.total_bytes and int4.gpu_bytes(gpu=False) == 0


def test_a_tensor_the_architecture_does_not_know_is_refused_as_the_loader_refuses_it():
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
              "num_attention_heads": 4, "vocab_size": 384, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 48, "max_position_embeddings": 512}
    with pytest.raises(UnsupportedModelError, match="unexpected tensor model.layers.0.mlp.gate.weight_scale_inv"):
        summarize(config, {"model.layers.0.mlp.gate.weight_scale_inv": TensorInfo((1,), "F32")})


def write_mixed_gguf(path, H=64, F=64, E=4, L=3):
    """A Mixtral-style GGUF whose layers hold their experts differently: layer 0 all q4_0, layer 1 q4_0 gate/up
    with a q8_0 down, layer 2 float16 (to be dequantised, or quantised at load)."""
    gen = torch.Generator().manual_seed(0)
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(4); w.add_head_count_kv(2); w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(H // 4); w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E)
    w.add_expert_used_count(2); w.add_vocab_size(len(pieces))
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def f16(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).half().numpy()

    def packed(fmt, *shape):
        kind = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}[fmt]
        return {"data": quantize(torch.randn(shape, generator=gen) * 0.02, fmt).numpy(), "raw_dtype": kind}

    kv = 2 * H // 4
    w.add_tensor("token_embd.weight", f16(len(pieces), H)); w.add_tensor("output.weight", f16(len(pieces), H))
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    layer_formats = [("q4_0", "q4_0"), ("q4_0", "q8_0"), (None, None)]
    for i, (gate_up, down) in enumerate(layer_formats[:L]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", f16(H, H)); w.add_tensor(p + "attn_k.weight", f16(kv, H))
        w.add_tensor(p + "attn_v.weight", f16(kv, H)); w.add_tensor(p + "attn_output.weight", f16(H, H))
        w.add_tensor(p + "ffn_gate_inp.weight", f16(E, H))
        for leaf, shape, fmt in (("gate", (E, F, H), gate_up), ("up", (E, F, H), gate_up), ("down", (E, H, F), down)):
            if fmt is None:
                w.add_tensor(f"{p}ffn_{leaf}_exps.weight", f16(*shape))
            else:
                t = packed(fmt, *shape)
                w.add_tensor(f"{p}ffn_{leaf}_exps.weight", t["data"], raw_dtype=t["raw_dtype"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.parametrize("expert_dtype", ["auto", "bf16", "int8", "int4"])
def test_estimate_equals_the_loaded_stacks_of_a_gguf(tmp_path, expert_dtype):
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path)
    weights = summarize_path(path)
    for dtype in ("float32", "bfloat16"):
        estimate = weights.estimate(expert_dtype, dtype)
        experts, other, _ = loaded_bytes(str(path), expert_dtype, dtype)
        assert (estimate.expert_bytes, estimate.other_bytes) == (experts, other), (expert_dtype, dtype)


def test_a_gguf_s_packed_experts_take_their_bytes_in_the_file(tmp_path):
    """auto keeps what the file holds: the estimate of layers 0 and 1 is the bytes of their expert tensors in the
    file, as GGUFReader reports them; the float16 layer 2 becomes the weights dtype, or q4_0 / q8_0 blocks."""
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path)
    reader = gguf.GGUFReader(str(path))
    in_file = {t.name: int(t.n_bytes) for t in reader.tensors if "_exps" in t.name}
    packed_layers = sum(n for name, n in in_file.items() if not name.startswith("blk.2."))
    E, H, F = 4, 64, 64
    weights = summarize_path(path)
    auto = weights.estimate("auto", "bfloat16")
    assert auto.expert_bytes == packed_layers + E * 3 * H * F * 2
    assert auto.experts_as == "q4_0/q8_0/bf16"
    int4 = weights.estimate("int4", "bfloat16")
    assert int4.expert_bytes == packed_layers + E * 3 * H * F // 32 * 18 and int4.experts_as == "q4_0/q8_0"
    assert weights.estimate("bf16", "bfloat16").expert_bytes == 3 * E * 3 * H * F * 2
