"""A .gguf file presented as a Hugging Face checkpoint: config dict, tensors under HF names, tokenizer.

Tensors are read lazily from the memory-mapped file and dequantized one at a time by the
`gguf` package. llama.cpp stores llama-family q/k projections permuted for its interleaved
RoPE; that permutation is undone here so the model code sees the Hugging Face layout.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from engine.errors import CheckpointError, UnsupportedModelError

# GGUF architecture -> (HF model_type for dense, for MoE)
_ARCHS = {
    "llama": ("llama", "mixtral"),
    "qwen2": ("qwen2", None),
    "qwen2moe": (None, "qwen2_moe"),
    "qwen3moe": (None, "qwen3_moe"),
    "olmoe": (None, "olmoe"),
}
_PERMUTED_QK = {"llama"}  # architectures whose converter permutes q/k for interleaved RoPE

# Pre-tokenizer splits for byte-level vocabularies, keyed by tokenizer.ggml.pre.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
for _gguf, _hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
    for _kind in ("weight", "bias"):
        _LAYER_NAMES[f"{_gguf}.{_kind}"] = f"self_attn.{_hf}.{_kind}"
_EXPERT_PROJ = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}


class GGUFCheckpoint:
    def __init__(self, path):
        self.path = Path(path)
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError, struct errors, numpy errors on bad files
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(self.path, f"not a readable GGUF file ({text})") from None
        self._fields = self._reader.fields
        self.arch = self._str("general.architecture")
        if self.arch not in _ARCHS:
            raise UnsupportedModelError(self.path, f"unsupported GGUF architecture {self.arch!r} "
                                                   f"(supported: {', '.join(sorted(_ARCHS))})")
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = self._config()
        self._names = self._hf_names()

    # metadata -----------------------------------------------------------------------------------
    def _value(self, key, default=...):
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(self.path, f"GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def _str(self, key, default=...):
        return self._value(key, default)

    def _arch_value(self, key, default=...):
        return self._value(f"{self.arch}.{key}", default)

    def _config(self) -> dict:
        experts = self._arch_value("expert_count", 0) or 0
        dense_type, moe_type = _ARCHS[self.arch]
        model_type = moe_type if experts else dense_type
        if model_type is None:
            raise UnsupportedModelError(self.path, f"GGUF architecture {self.arch!r} without experts is not supported")
        hidden = self._arch_value("embedding_length")
        heads = self._arch_value("attention.head_count")
        tokens = self._value("tokenizer.ggml.tokens", None)
        cfg = {
            "model_type": model_type,
            "vocab_size": self._arch_value("vocab_size", None) or (len(tokens) if tokens else None),
            "hidden_size": hidden,
            "intermediate_size": self._arch_value("feed_forward_length", 0),
            "num_hidden_layers": self._arch_value("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_value("attention.head_count_kv", heads),
            "rms_norm_eps": self._arch_value("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch_value("rope.freq_base", 10000.0),
            "max_position_embeddings": self._arch_value("context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self._value("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._value("tokenizer.ggml.eos_token_id", None),
        }
        head_dim = self._arch_value("attention.key_length", None)
        if head_dim and head_dim != hidden // heads:
            cfg["head_dim"] = head_dim
        scaling = self._arch_value("rope.scaling.type", None)
        if scaling and scaling != "none":
            cfg["rope_scaling"] = {"type": scaling, "factor": self._arch_value("rope.scaling.factor", 1.0)}
        if experts:
            cfg["num_local_experts" if model_type == "mixtral" else "num_experts"] = experts
            cfg["num_experts_per_tok"] = self._arch_value("expert_used_count")
            width = self._arch_value("expert_feed_forward_length", None)
            if model_type in ("mixtral", "olmoe"):
                cfg["intermediate_size"] = width or cfg["intermediate_size"]
            else:
                cfg["moe_intermediate_size"] = width or cfg["intermediate_size"]
            if model_type == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = self._arch_value("expert_shared_feed_forward_length", 0)
            if model_type != "mixtral":
                # llama.cpp normalises top-k weights for Qwen3-MoE, not for Qwen2-MoE or OLMoE.
                cfg["norm_topk_prob"] = self._arch_value("expert_weights_norm", model_type == "qwen3_moe")
        return cfg

    # tensors ------------------------------------------------------------------------------------
    def _hf_names(self) -> dict[str, tuple[str, int | None]]:
        """HF name -> (GGUF tensor name, expert index within a stacked tensor or None)."""
        moe_block = "block_sparse_moe" if self.config["model_type"] == "mixtral" else "mlp"
        expert_style = 0 if moe_block == "block_sparse_moe" else 1
        names = {}
        for name, tensor in self._tensors.items():
            if name == "token_embd.weight":
                names["model.embed_tokens.weight"] = (name, None)
            elif name == "output_norm.weight":
                names["model.norm.weight"] = (name, None)
            elif name == "output.weight":
                names["lm_head.weight"] = (name, None)
            elif name.startswith("blk."):
                _, layer, rest = name.split(".", 2)
                prefix = f"model.layers.{layer}."
                stacked = re.fullmatch(r"ffn_(gate|up|down)_exps\.weight", rest)
                single = re.fullmatch(r"ffn_(gate|up|down)\.(\d+)\.weight", rest)  # older Mixtral files
                if rest in _LAYER_NAMES:
                    names[prefix + _LAYER_NAMES[rest]] = (name, None)
                elif rest == "ffn_gate_inp.weight":
                    names[prefix + f"{moe_block}.gate.weight"] = (name, None)
                elif stacked:
                    proj = _EXPERT_PROJ[stacked.group(1)][expert_style]
                    for e in range(int(tensor.shape[-1])):
                        names[prefix + f"{moe_block}.experts.{e}.{proj}.weight"] = (name, e)
                elif single:
                    proj = _EXPERT_PROJ[single.group(1)][expert_style]
                    names[prefix + f"{moe_block}.experts.{single.group(2)}.{proj}.weight"] = (name, None)
                else:
                    raise UnsupportedModelError(self.path, f"unexpected GGUF tensor {name}")
            elif name.startswith("rope_freqs"):
                continue  # llama3 rope factors; recomputed from the config
            else:
                raise UnsupportedModelError(self.path, f"unexpected GGUF tensor {name}")
        return names

    def keys(self) -> list[str]:
        return list(self._names)

    def get_tensor(self, name: str) -> torch.Tensor:
        gguf_name, expert = self._names[name]
        array = self._read(gguf_name, expert)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(1, -1)
        if self.arch in _PERMUTED_QK and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
            array = _unpermute(array, heads)
        return torch.from_numpy(np.array(array, copy=True, order="C"))  # the file is mapped read-only

    def _read(self, gguf_name: str, expert: int | None) -> np.ndarray:
        tensor = self._tensors[gguf_name]
        data = tensor.data if expert is None else tensor.data[expert]
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if expert is not None:
            shape = shape[1:]
        qtype = tensor.tensor_type
        try:
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = np.asarray(data)
            else:
                array = dequantize(np.asarray(data), qtype)
            return array.reshape(shape)
        except NotImplementedError:
            raise CheckpointError(self.path, f"tensor {gguf_name} has type {qtype.name}, which the gguf "
                                             f"package cannot dequantize") from None
        except (ValueError, IndexError, OSError) as e:
            raise CheckpointError(self.path, f"cannot read tensor {gguf_name} ({e}); is the file truncated?") from None

    # tokenizer ----------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> tokenizers.Tokenizer | None:
        kind = self._value("tokenizer.ggml.model", None)
        if kind is None:
            return None
        tokens = list(self._value("tokenizer.ggml.tokens"))
        types = list(self._value("tokenizer.ggml.token_type", [1] * len(tokens)))
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, list(self._value("tokenizer.ggml.merges")),
                                  self._value("tokenizer.ggml.pre", "default"))
            byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
            control = [t for t, kind_ in zip(tokens, types) if kind_ == 3 and set(t) <= byte_alphabet]
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, list(self._value("tokenizer.ggml.scores")),
                                     self._value("tokenizer.ggml.add_space_prefix", True))
            control = [t for t, kind_ in zip(tokens, types) if kind_ == 3]
        else:
            raise UnsupportedModelError(self.path, f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, kind_ in zip(tokens, types) if kind_ == 4]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        return tok

    @property
    def tokenizer_config(self) -> dict:
        tokens = self._value("tokenizer.ggml.tokens", None) or []
        kind = self._value("tokenizer.ggml.model", None)

        def token(key):
            index = self._value(f"tokenizer.ggml.{key}", None)
            return tokens[index] if index is not None and index < len(tokens) else None

        config = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                  "add_bos_token": bool(self._value("tokenizer.ggml.add_bos_token", kind == "llama"))}
        template = self._value("tokenizer.chat_template", None)
        if template:
            config["chat_template"] = template
        return config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (pairs interleaved per head) back to half-split rows."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_level_bpe(tokens, merges, pre: str) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    split = _SPLITS.get(pre)
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens, scores, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE: merges are the vocabulary's own pieces, ranked by score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in sorted(zip(tokens, scores), key=lambda p: -p[1]):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges],
                                          byte_fallback=True, fuse_unk=True, unk_token=tokens[0]))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok
