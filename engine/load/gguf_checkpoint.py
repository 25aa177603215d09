"""A .gguf file read as if it were a Hugging Face checkpoint folder.

`GGUFCheckpoint` shows the same face as `engine.load.checkpoint.SafetensorsCheckpoint`: a config.json
dict, tensors under the Hub's names and in its layout, a `tokenizers.Tokenizer` and a
tokenizer_config dict. Everything llama.cpp's converter changed on the way into GGUF is undone
here, so the rest of the engine never knows the model came from a GGUF file:

- names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`;
- dims: GGUF lists them fastest-first, torch slowest-first;
- experts: stacked into one [E, F, H] tensor per projection; the Hub keeps one per expert;
- llama q/k rows: permuted for llama.cpp's interleaved RoPE; the Hub uses half-split RoPE;
- quantization: blocks are dequantized by the `gguf` package, one tensor at a time, except routed
  experts in a format moedesk computes from directly (kernels.quant_formats), which `read_packed`
  hands over as they are.

The file stays memory-mapped (GGUFReader); nothing is read until `get_tensor` asks for it. A GGUF split in parts
(engine.load.gguf_split) opens from any part: its metadata from the first, its tensors from each part's file.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.load.gguf_split import Joined, open_gguf
from moedesk.kernels.quant_formats import BY_GGML_TYPE

# general.architecture -> Hugging Face model_type (without experts, with experts).
_MODEL_TYPES = {
    "llama": ("llama", "mixtral"),
    "qwen2": ("qwen2", None),
    "qwen2moe": (None, "qwen2_moe"),
    "qwen3moe": (None, "qwen3_moe"),
    "olmoe": (None, "olmoe"),
    "glm4moe": (None, "glm4_moe"),
    "gpt-oss": (None, "gpt_oss"),
    "qwen3next": (None, "qwen3_next"),
    "qwen35moe": (None, "qwen3_5_moe"),
    "deepseek2": (None, "deepseek_v3"),  # DeepSeek-V3/R1, Kimi-K2 and GLM-4.7-Flash: MLA, sigmoid routing
    "minimax-m2": (None, "minimax_m2"),
}
# The GGUF architectures the native engine runs; llama.cpp runs the others (engine.load.size_estimate sizes them).
NATIVE_ARCHITECTURES = frozenset(_MODEL_TYPES)
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM"}
# llama.cpp runs these with its interleaved ("normal") RoPE, so its converter reorders their q/k
# rows; the other architectures use NEOX RoPE, the Hub's own layout, and are stored as they are.
_PERMUTED_QK_ARCHS = {"llama"}

# GGUF tensor names -> Hub names. "{moe}" is the MoE module: Mixtral calls it block_sparse_moe; "{shared}" the
# shared expert's (shared_experts in GLM-4.x).
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # glm4moe's name of the same norm
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.{router}",
    "ffn_gate_shexp": "mlp.{shared}.gate_proj",
    "ffn_up_shexp": "mlp.{shared}.up_proj",
    "ffn_down_shexp": "mlp.{shared}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # Gated DeltaNet (qwen3next, qwen35moe)
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    # MLA (deepseek2): the query bottleneck, the latent's projection and norm, its expansion (older files whole)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
# Newer deepseek2 files split kv_b per head into K's part, transposed ([heads, rank, nope]), and V's ([heads, v,
# rank]) for llama.cpp's absorbed attention; joined back into the Hub's kv_b_proj [heads * (nope + v), rank].
_SPLIT_KV_B = ("attn_k_b", "attn_v_b")
# Whole names whose Hub name is not module + kind: the sigmoid router's correction bias (in the MoE module, where
# its architecture keeps it), gpt-oss's sinks, Gated DeltaNet's time-step bias.
_LAYER_TENSORS_WHOLE = {"exp_probs_b.bias": "{moe}.{score_bias}", "attn_sinks.weight": "self_attn.sinks",
                        "ssm_dt.bias": "linear_attn.dt_bias"}
# Gated DeltaNet's decay rate: llama.cpp keeps A = -exp(A_log), under a name without a kind.
_SSM_A = re.compile(r"blk\.(\d+)\.ssm_a")
# Norms that transformers' Qwen3-Next scales by 1 + weight and llama.cpp's converter stores plus one.
_OFFSET_NORMS = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm"}
# Value-head-indexed Gated DeltaNet tensors of qwen35moe: llama.cpp tiles value heads over key heads (k0v0 k1v0 k0v1
# ...); the Hub groups them by key head (k0v0 k0v1 k1v0 ...). (leaf, dim, which rows: all, or only past q and k)
_BY_VALUE_HEAD = {"ssm_a": (0, "all"), "ssm_dt": (0, "all"), "ssm_alpha": (0, "all"), "ssm_beta": (0, "all"),
                  "attn_gate": (0, "all"), "ssm_out": (1, "all"), "attn_qkv": (0, "values"),
                  "ssm_conv1d": (0, "values")}
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# blk.{layer}.{leaf}[.{expert}].{weight|bias}; a numbered expert is how older Mixtral files store them.
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)")
_BLOCK_NUMBER = re.compile(r"blk\.(\d+)\.")
_MOST_LAYERS = 1024  # engine.model.architectures bounds num_hidden_layers alike; a vocabulary-only file has no layers to count
_STACKED_EXPERTS = re.compile(r"ffn_(gate|up|down)_exps")

# Byte-level BPE splits, keyed by tokenizer.ggml.pre: the regex the vocabulary's merges were
# learned with (the model's tokenizer.json; llama.cpp's llama-vocab.cpp holds the same list).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
_DIGITS_PRE = {"smollm", "starcoder", "refact"}  # each digit alone, then GPT-2's split


class GGUFCheckpoint:
    """A .gguf file: `config`, `keys()`, `get_tensor(name)`, `tokenizer`, `tokenizer_config`."""

    def __init__(self, path, header=None):
        """`path`: a .gguf file, or any part of a split one (engine.load.gguf_split: the metadata from the first
        part, which then names the model, the tensors from every part, each memory-mapped as a single file is).
        `header`: the file's header already parsed (engine.load.gguf_header, from bytes fetched without the
        tensor data) instead of the file at `path`, which then only names it in messages: `config`, `shapes()` and
        `packed_format()` answer from it, nothing reads tensors."""
        self._fetched = header is not None  # its tensors' bytes came with the header (from the Hub): no file here
        if header is None:
            self._reader = open_gguf(Path(path), _open_reader)
        else:
            tensors = list(header.tensors)
            self._reader = Joined(header.fields, tensors, dict.fromkeys((t.name for t in tensors), 0), (Path(path),))
        self.path = Path(self._reader.paths[0])
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._files: dict[int, object] = {}  # each part's file, once a read needs it
        self.arch = self._meta("general.architecture", str)
        if self.arch not in _MODEL_TYPES:
            raise UnsupportedModelError(self.path, f"unsupported GGUF architecture {self.arch!r} "
                                                   f"(supported: {', '.join(sorted(_MODEL_TYPES))})")
        self.config = self._build_config()
        self._index = self._build_index()

    # metadata ----------------------------------------------------------------------------------

    def _meta(self, key: str, kind: type, default=...):
        """One metadata value, checked to be of `kind`; a missing key without a default is an error."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(self.path, f"GGUF metadata has no {key!r}")
            return default
        value = field.contents()
        if field.types[0] == GGUFValueType.FLOAT32:
            # Stored as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that is the
            # same float32 is what the model's config.json said, and computes identically.
            value = float(str(np.float32(value)))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(self.path, f"GGUF metadata {key!r} is {type(value).__name__}, "
                                             f"expected {kind.__name__}")
        return value

    def _arch_meta(self, key: str, kind: type, default=...):
        return self._meta(f"{self.arch}.{key}", kind, default)

    def _build_config(self) -> dict:
        experts = self._arch_meta("expert_count", int, 0)
        model_type = _MODEL_TYPES[self.arch][1 if experts else 0]
        if model_type is None:
            raise UnsupportedModelError(self.path, f"GGUF architecture {self.arch!r} without experts is not supported")
        hidden = self._arch_meta("embedding_length", int)
        heads = self._arch_meta("attention.head_count", int)
        kv_heads = self._arch_meta("attention.head_count_kv", int, heads)
        if self.arch == "deepseek2":
            return self._with_latent_attention(hidden, heads)
        head_dim = self._arch_meta("attention.key_length", int, hidden // heads)
        if self._arch_meta("attention.value_length", int, head_dim) != head_dim:
            raise UnsupportedModelError(self.path, "attention.value_length differs from attention.key_length")
        config = self._common_config(model_type, hidden, heads, kv_heads)
        if head_dim != hidden // heads:
            config["head_dim"] = head_dim
        rotary = self._arch_meta("rope.dimension_count", int, head_dim)
        if rotary != head_dim:  # stated so that a loader that cannot run partial RoPE refuses it
            config["partial_rotary_factor"] = rotary / head_dim
        if (scaling := self._rope_scaling()) is not None:
            config["rope_scaling"] = scaling
        if (clip := self._arch_meta("attention.clamp_kqv", float, None)) is not None:
            config["clip_qkv"] = clip  # OLMoE
        if experts:
            config.update(self._moe_config(model_type, experts))
        return config

    def _common_config(self, model_type: str, hidden: int, heads: int, kv_heads: int) -> dict:
        embeddings = self._tensors.get("token_embd.weight")
        vocab_size = self._arch_meta("vocab_size", int, None)
        if vocab_size is None:  # older files: the vocabulary's length, or the embedding's rows
            tokens = self._meta("tokenizer.ggml.tokens", list, None)
            vocab_size = len(tokens) if tokens else int(embeddings.shape[-1]) if embeddings is not None else None
        if vocab_size is None:
            raise CheckpointError(self.path, "GGUF file states no vocabulary size and has no token_embd.weight")
        config = {
            "architectures": [_HF_CLASSES[model_type]],
            "model_type": model_type,
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": self._arch_meta("feed_forward_length", int, 0),
            "num_hidden_layers": self._block_count() - self._mtp_layers(),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": self._arch_meta("attention.layer_norm_rms_epsilon", float),
            "rope_theta": self._arch_meta("rope.freq_base", float, 10000.0),
            "max_position_embeddings": self._arch_meta("context_length", int),
            # llama.cpp writes output.weight only when it is not the embedding matrix.
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id", int, None),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id", int, None),
        }
        if (pad := self._meta("tokenizer.ggml.padding_token_id", int, None)) is not None:
            config["pad_token_id"] = pad
        return config

    def _with_latent_attention(self, hidden: int, heads: int) -> dict:
        """deepseek2's config: MLA's ranks and head widths, yarn with DeepSeek's softmax scale, the routing.
        Newer files state the per-head widths as key/value_length_mla (key/value_length then being the latent's,
        as llama.cpp attends it); older ones as key/value_length."""
        experts = self._arch_meta("expert_count", int, 0)
        rope = self._arch_meta("rope.dimension_count", int)
        key = self._arch_meta("attention.key_length_mla", int, None) or self._arch_meta("attention.key_length", int)
        value = self._arch_meta("attention.value_length_mla", int, None) or self._arch_meta("attention.value_length",
                                                                                            int)
        if key <= rope:
            raise CheckpointError(self.path, f"GGUF key length {key} leaves no room beside {rope} rotary dims")
        config = self._common_config("deepseek_v3", hidden, heads, heads)
        config.update(kv_lora_rank=self._arch_meta("attention.kv_lora_rank", int),
                      q_lora_rank=self._arch_meta("attention.q_lora_rank", int, 0) or None,
                      qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value, rope_interleave=True)
        if (scaling := self._rope_scaling()) is not None:
            if scaling["rope_type"] == "yarn":
                # llama.cpp's yarn_log_multiplier is 0.1 x the Hub's mscale_all_dim; with mscale equal to it the
                # rotary tables stay unscaled and the softmax scale takes the whole factor, as llama.cpp computes.
                all_dim = self._arch_meta("rope.scaling.yarn_log_multiplier", float, 0.0) / 0.1
                if all_dim:
                    scaling.update(mscale=all_dim, mscale_all_dim=all_dim)
            config["rope_scaling"] = scaling
        config.update(self._routed_config(experts, norm_default=False))
        return config

    def _rope_scaling(self) -> dict | None:
        if "rope_freqs.weight" in self._tensors:
            # Llama 3.1-style scaling is stored only as per-dimension factors, not as the parameters
            # a config.json needs; running without them would silently change every position.
            factors = self._read(self._tensors["rope_freqs.weight"], None)
            if not torch.all(factors == 1):
                raise UnsupportedModelError(self.path, "RoPE scaling stored as rope_freqs factors "
                                                       "(Llama 3.1 style) is not supported for GGUF files")
        kind = self._arch_meta("rope.scaling.type", str, None)
        factor = self._arch_meta("rope.scaling.factor", float, None)
        if kind is None and self._arch_meta("rope.scale_linear", float, 1.0) != 1.0:  # older files
            kind, factor = "linear", self._arch_meta("rope.scale_linear", float)
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, "factor": factor}
        if (original := self._arch_meta("rope.scaling.original_context_length", int, None)) is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def _block_count(self) -> int:
        """block_count, checked against the layers the file has tensors for before anything loops over it."""
        count = self._arch_meta("block_count", int)
        layers = {int(m.group(1)) for name in self._tensors if (m := _LAYER_TENSOR_NAME.fullmatch(name))}
        if not 1 <= count <= _MOST_LAYERS or layers and layers != set(range(count)):
            have = f"layers {min(layers)}-{max(layers)}" if layers else "no layer tensors"
            raise CheckpointError(self.path, f"GGUF metadata says block_count {count}, but the file has {have}")
        return count

    def _mtp_layers(self) -> int:
        """Trailing layers for multi-token prediction (glm4moe writes them as ordinary blocks): not loaded."""
        mtp = self._arch_meta("nextn_predict_layers", int, 0)
        if not 0 <= mtp < self._block_count():
            raise CheckpointError(self.path, f"GGUF metadata says nextn_predict_layers {mtp} of "
                                             f"{self._block_count()} blocks")
        return mtp

    def _moe_config(self, model_type: str, experts: int) -> dict:
        if model_type == "glm4_moe":
            return self._glm4_moe_config(experts)
        if model_type == "gpt_oss":
            return self._gpt_oss_config(experts)
        if model_type in ("qwen3_next", "qwen3_5_moe"):
            return self._delta_net_config(experts)
        if model_type == "minimax_m2":
            return self._minimax_m2_config(experts)
        moe = {"num_local_experts" if model_type == "mixtral" else "num_experts": experts,
               "num_experts_per_tok": self._arch_meta("expert_used_count", int)}
        width = self._arch_meta("expert_feed_forward_length", int, None) or self._arch_meta("feed_forward_length", int)
        if model_type in ("mixtral", "olmoe"):  # their configs call the expert width intermediate_size
            moe["intermediate_size"] = width
        else:
            moe["moe_intermediate_size"] = width
        if model_type == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = self._arch_meta("expert_shared_feed_forward_length", int)
        if model_type != "mixtral":
            # Whether llama.cpp renormalises the top-k weights: an explicit key where the file has
            # one, else what llama.cpp hard-codes per architecture (only Qwen3-MoE does).
            moe["norm_topk_prob"] = self._arch_meta("expert_weights_norm", bool, model_type == "qwen3_moe")
        if model_type in ("qwen2_moe", "qwen3_moe"):
            # A layer without a router is a dense MLP layer.
            layers = range(self._block_count())
            if dense := [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors]:
                moe["mlp_only_layers"] = dense
        return moe

    def _glm4_moe_config(self, experts: int) -> dict:
        head_dim = self._arch_meta("attention.key_length", int,
                                   self._arch_meta("embedding_length", int) // self._arch_meta("attention.head_count", int))
        return {
            **self._routed_config(experts, norm_default=True),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in self._tensors,
            # Said even when whole: a config.json without it means half (transformers' default for GLM-4.x).
            "partial_rotary_factor": self._arch_meta("rope.dimension_count", int, head_dim) / head_dim,
        }

    def _routed_config(self, experts: int, norm_default: bool) -> dict:
        """Sigmoid scores with a correction bias, group-limited top-k, shared experts, dense first layers (GLM-4.x,
        DeepSeek-V3). norm_default: whether llama.cpp renormalises the top k where the file does not say."""
        self._sigmoid_gating()
        return {
            "n_routed_experts": experts,
            "num_experts_per_tok": self._arch_meta("expert_used_count", int),
            "moe_intermediate_size": self._arch_meta("expert_feed_forward_length", int),
            "n_shared_experts": self._arch_meta("expert_shared_count", int, 0),
            "first_k_dense_replace": self._arch_meta("leading_dense_block_count", int, 0),
            "routed_scaling_factor": self._arch_meta("expert_weights_scale", float, 1.0),
            "norm_topk_prob": self._arch_meta("expert_weights_norm", bool, norm_default),
            "n_group": self._arch_meta("expert_group_count", int, 1),
            "topk_group": self._arch_meta("expert_group_used_count", int, 1),
            "num_nextn_predict_layers": self._mtp_layers(),
        }

    def _minimax_m2_config(self, experts: int) -> dict:
        """MiniMax-M2: sigmoid routing with a correction bias, the top k always renormalised (llama.cpp hard-codes it
        as transformers does); its partial RoPE is the common rope.dimension_count."""
        self._sigmoid_gating()
        return {"num_local_experts": experts, "num_experts_per_tok": self._arch_meta("expert_used_count", int),
                "intermediate_size": self._arch_meta("expert_feed_forward_length", int)}

    def _sigmoid_gating(self) -> None:
        gating = self._arch_meta("expert_gating_func", int, _SIGMOID_GATING)
        if gating != _SIGMOID_GATING:
            raise UnsupportedModelError(self.path, f"{self.arch} with expert_gating_func {gating} (moedesk runs the "
                                                   f"sigmoid gating, {_SIGMOID_GATING})")

    def _delta_net_config(self, experts: int) -> dict:
        """Qwen3-Next / Qwen3.5-MoE: the Gated DeltaNet dims from llama.cpp's ssm keys, every
        full_attention_interval-th layer full attention (what llama.cpp assumes too)."""
        value_heads = self._arch_meta("ssm.time_step_rank", int)
        layers = self._block_count()
        interval = self._arch_meta("full_attention_interval", int, 4)
        return {
            "num_experts": experts,
            "num_experts_per_tok": self._arch_meta("expert_used_count", int),
            "moe_intermediate_size": self._arch_meta("expert_feed_forward_length", int),
            "shared_expert_intermediate_size": self._arch_meta("expert_shared_feed_forward_length", int),
            "norm_topk_prob": True,
            "linear_conv_kernel_dim": self._arch_meta("ssm.conv_kernel", int),
            "linear_key_head_dim": self._arch_meta("ssm.state_size", int),
            "linear_num_key_heads": self._arch_meta("ssm.group_count", int),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": self._arch_meta("ssm.inner_size", int) // max(value_heads, 1),
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        }

    def _gpt_oss_config(self, experts: int) -> dict:
        """llama.cpp writes the window but not which layers slide (it hard-codes every other one from the first)
        nor the activation's constants (the reference's alpha and limit); the pattern is read where a file has it."""
        layers = self._block_count()
        pattern = self._meta(f"{self.arch}.attention.sliding_window_pattern", list, None)
        slides = [bool(p) for p in pattern] if pattern else [i % 2 == 0 for i in range(layers)]
        config = {
            "num_local_experts": experts,
            "num_experts_per_tok": self._arch_meta("expert_used_count", int),
            "intermediate_size": self._arch_meta("expert_feed_forward_length", int),
            "sliding_window": self._arch_meta("attention.sliding_window", int),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        }
        rope = self._rope_scaling()
        if rope is not None and rope["rope_type"] == "yarn":  # gpt-oss's yarn keeps fractional corrections
            rope.update(truncate=False, beta_fast=self._arch_meta("rope.scaling.yarn_beta_fast", float, 32.0),
                        beta_slow=self._arch_meta("rope.scaling.yarn_beta_slow", float, 1.0))
            config["rope_scaling"] = rope
        return config

    # tensors -----------------------------------------------------------------------------------

    def _build_index(self) -> dict[str, tuple[str, int | None]]:
        """Hub name -> (GGUF tensor name, expert index inside a stacked tensor, or None)."""
        from moedesk.engine.model.architectures import ARCHITECTURES

        model_type = self.config["model_type"]
        arch = ARCHITECTURES[model_type]
        moe, shared, router = arch.moe_block, arch.shared_expert_name, arch.router_name
        names = dict(moe=moe, shared=shared, router=router, score_bias=arch.score_bias_name)
        self._joined_biases: dict[str, dict[str, str]] = {}  # Hub name -> {GGUF leaf: GGUF name}
        self._joined_kv_b: dict[str, dict[str, str]] = {}  # likewise, kv_b_proj from attn_k_b and attn_v_b
        layers = self.config["num_hidden_layers"]
        expert_proj = dict(zip(("gate", "up", "down"), arch.expert_proj))
        index = {}
        for name, tensor in self._tensors.items():
            stem, _, kind = name.rpartition(".")
            if stem in _GLOBAL_TENSORS:
                index[f"{_GLOBAL_TENSORS[stem]}.{kind}"] = (name, None)
                continue
            if name == "rope_freqs.weight":
                continue  # all ones (anything else was refused in the config): plain RoPE
            if (block := _BLOCK_NUMBER.match(name)) and int(block.group(1)) >= layers:
                continue  # a multi-token prediction layer (`_mtp_layers`), nextn.* tensors and all
            if a := _SSM_A.fullmatch(name):
                index[f"model.layers.{a.group(1)}.linear_attn.A_log"] = (name, None)
                continue
            m = _LAYER_TENSOR_NAME.fullmatch(name)
            if m is None:
                raise UnsupportedModelError(self.path, f"unexpected GGUF tensor {name}")
            layer, leaf, expert, kind = m.groups()
            prefix = f"model.layers.{layer}."
            if kind == "bias" and _STACKED_EXPERTS.fullmatch(leaf):  # gpt-oss: a layer's expert biases, stacked
                if leaf == "ffn_down_exps":
                    index[f"{prefix}mlp.experts.down_proj_bias"] = (name, None)
                else:  # gate's [E, F] and up's [E, F] become one [E, 2F], gate's first (MoE.gate_up_bias)
                    self._joined_biases.setdefault(f"{prefix}mlp.experts.gate_up_proj_bias", {})[leaf] = name
            elif stacked := _STACKED_EXPERTS.fullmatch(leaf):
                proj = expert_proj[stacked.group(1)]
                for e in range(int(tensor.shape[-1])):  # GGUF dims are reversed: experts come last
                    index[f"{prefix}{moe}.experts.{e}.{proj}.{kind}"] = (name, e)
            elif expert is not None and leaf in ("ffn_gate", "ffn_up", "ffn_down"):
                proj = expert_proj[leaf.removeprefix("ffn_")]
                index[f"{prefix}{moe}.experts.{expert}.{proj}.{kind}"] = (name, None)
            elif expert is None and leaf in _SPLIT_KV_B and kind == "weight":
                self._joined_kv_b.setdefault(f"{prefix}self_attn.kv_b_proj.weight", {})[leaf] = name
            elif expert is None and f"{leaf}.{kind}" in _LAYER_TENSORS_WHOLE:
                index[prefix + _LAYER_TENSORS_WHOLE[f"{leaf}.{kind}"].format(**names)] = (name, None)
            elif expert is None and leaf in _LAYER_TENSORS:
                index[f"{prefix}{_LAYER_TENSORS[leaf].format(**names)}.{kind}"] = (name, None)
            else:
                raise UnsupportedModelError(self.path, f"unexpected GGUF tensor {name}")
        return index

    def keys(self) -> list[str]:
        return list(self._index) + list(self._joined_biases) + list(self._joined_kv_b)

    def _joined(self, name: str) -> list[str]:
        parts = self._joined_biases[name]
        if set(parts) != {"ffn_gate_exps", "ffn_up_exps"}:
            raise CheckpointError(self.path, f"GGUF has {', '.join(sorted(parts.values()))} without its counterpart "
                                             f"(ffn_gate_exps.bias and ffn_up_exps.bias go together)")
        return [parts["ffn_gate_exps"], parts["ffn_up_exps"]]

    def _split_kv_b(self, name: str) -> tuple[str, str]:
        parts = self._joined_kv_b[name]
        if set(parts) != set(_SPLIT_KV_B):
            raise CheckpointError(self.path, f"GGUF has {', '.join(sorted(parts.values()))} without its counterpart "
                                             f"(attn_k_b and attn_v_b go together)")
        return parts["attn_k_b"], parts["attn_v_b"]

    def _kv_b_shape(self, name: str) -> tuple[int, int]:
        """kv_b_proj's Hub shape [heads * (nope + v), rank] from k_b [heads, rank, nope] and v_b [heads, v, rank]."""
        k, v = (tuple(int(d) for d in reversed(self._tensors[n].shape)) for n in self._split_kv_b(name))
        if len(k) != 3 or len(v) != 3 or k[0] != v[0] or k[1] != v[2]:
            raise CheckpointError(self.path, f"GGUF attn_k_b {k} and attn_v_b {v} do not split one kv_b projection")
        return k[0] * (k[2] + v[1]), k[1]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in Hub layout, from the file's header alone (what parse_config checks the
        config against before anything is allocated)."""
        shapes = {}
        for name, (gguf_name, expert) in self._index.items():
            dims = tuple(int(d) for d in reversed(self._tensors[gguf_name].shape))
            shapes[name] = dims if expert is None else dims[1:]
        for name in self._joined_biases:
            gate, up = (tuple(int(d) for d in reversed(self._tensors[n].shape)) for n in self._joined(name))
            shapes[name] = (gate[0], gate[1] + up[1])
        for name in self._joined_kv_b:
            shapes[name] = self._kv_b_shape(name)
        return shapes

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor in Hub layout: float32 if it was quantized, else its stored dtype."""
        if name in self._joined_biases:
            return torch.cat([self._read(self._tensors[n], None) for n in self._joined(name)], dim=1)
        if name in self._joined_kv_b:
            shape = self._kv_b_shape(name)
            k_b, v_b = (self._read(self._tensors[n], None) for n in self._split_kv_b(name))
            return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(shape)
        gguf_name, expert = self._index[name]
        tensor = self._read(self._tensors[gguf_name], expert)
        leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self.arch in _PERMUTED_QK_ARCHS and leaf in ("attn_q", "attn_k"):
            heads = self.config["num_attention_heads" if leaf == "attn_q" else "num_key_value_heads"]
            tensor = _undo_rope_permutation(tensor, heads)
        if leaf == "ffn_gate_inp_shexp" and tensor.dim() == 1:
            tensor = tensor.reshape(1, -1)  # the Hub's Linear(hidden, 1); llama.cpp drops the 1
        if self.config["model_type"] in ("qwen3_next", "qwen3_5_moe"):
            tensor = self._delta_net_layout(gguf_name, leaf, tensor)
        return tensor

    def _delta_net_layout(self, gguf_name: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo what llama.cpp's converter does to Qwen3-Next / Qwen3.5-MoE tensors: norms stored plus one, A stored
        as -exp(A_log), the convolution without its middle dim, and (qwen35moe) value heads tiled over key heads."""
        if gguf_name == "output_norm.weight" or leaf in _OFFSET_NORMS:
            return tensor - 1
        is_a = leaf == "ssm_a"
        if self.arch == "qwen35moe" and leaf in _BY_VALUE_HEAD:
            tensor = self._group_value_heads(tensor, *_BY_VALUE_HEAD[leaf], leaf)
        if is_a:
            if not bool((tensor < 0).all()):  # log(-A) would be NaN: every later token too
                raise CheckpointError(self.path, f"tensor {gguf_name} holds A = -exp(A_log), which must be negative")
            return torch.log(-tensor)
        if leaf == "ssm_conv1d":
            return tensor.unsqueeze(1)
        return tensor

    def _group_value_heads(self, tensor: torch.Tensor, dim: int, rows: str, leaf: str) -> torch.Tensor:
        c = self.config
        key_heads, value_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
        per_key = value_heads // key_heads
        if per_key == 1:
            return tensor
        head_dim = 1 if leaf in ("ssm_a", "ssm_dt", "ssm_alpha", "ssm_beta") else c["linear_value_head_dim"]
        if rows == "values":  # q and k rows first, as they are
            keys = 2 * key_heads * c["linear_key_head_dim"]
            return torch.cat([tensor[:keys], self._group_value_heads(tensor[keys:], dim, "all", leaf)])
        shape = list(tensor.shape)
        tiled = tensor.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1:])
        return tiled.transpose(dim, dim + 1).reshape(shape)

    def packed_format(self, name: str) -> str | None:
        """The packed format (kernels.quant_formats) a tensor is stored in, when its blocks can be computed
        from as they are; None for float tensors and other quantisations (those are dequantised)."""
        if name in self._joined_biases or name in self._joined_kv_b:
            return None
        gguf_name, _ = self._index[name]
        fmt = BY_GGML_TYPE.get(int(self._tensors[gguf_name].tensor_type))
        return None if fmt is None else fmt.name

    def tensor_dtype(self, name: str) -> str:
        """A tensor's GGML type name (F32, F16, BF16, Q4_K...): BF16 and F32 are also safetensors' names for them."""
        gguf_name, _ = self._index[name]
        return GGMLQuantizationType(int(self._tensors[gguf_name].tensor_type)).name

    def packed_rows_format(self, name: str) -> str | None:
        """The packed format `read_packed_rows` hands a tensor over in; None where it cannot (see there)."""
        fmt = self.packed_format(name)
        if fmt is None:
            return None
        gguf_name, expert = self._index[name]
        leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if (expert is not None or len(self._tensors[gguf_name].shape) != 2 or leaf == "ffn_gate_inp_shexp"
                or (self.arch == "qwen35moe" and leaf in _BY_VALUE_HEAD)):
            return None
        return fmt

    def read_packed_rows(self, name: str) -> torch.Tensor | None:
        """A whole 2-D tensor's packed blocks as rows [R, row_bytes] (uint8, Hub row order: llama's q/k rows
        un-permuted, a row's blocks being self-contained), for a weight kept packed (engine.model.packed_linear);
        None where it is not stored in a packed format, is an expert's slice, or its conversion moves columns or
        regroups heads (Qwen3.5's value-head tensors, a reshaped gate), which only its floats can undo."""
        if self.packed_rows_format(name) is None:
            return None
        gguf_name, _ = self._index[name]
        tensor = self._tensors[gguf_name]
        leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        rows = int(tensor.shape[1])
        out = torch.empty(rows, tensor.data.size // rows, dtype=torch.uint8)
        self._read_into(tensor, None, out.numpy())
        if self.arch in _PERMUTED_QK_ARCHS and leaf in ("attn_q", "attn_k"):
            heads = self.config["num_attention_heads" if leaf == "attn_q" else "num_key_value_heads"]
            out = _undo_rope_permutation(out, heads).contiguous()
        return out

    def read_packed(self, name: str, out: torch.Tensor) -> None:
        """Copy a packed tensor's blocks ([rows, row_bytes], no layout change: experts are never permuted)
        into the uint8 tensor `out`, read from the file with plain reads rather than through the memory map,
        so that the file's pages do not count against the process while the model is resident."""
        gguf_name, expert = self._index[name]
        tensor = self._tensors[gguf_name]
        data = tensor.data if expert is None else tensor.data[expert]
        if out.dtype != torch.uint8 or out.numel() != data.size or not out.is_contiguous():
            raise CheckpointError(self.path, f"tensor {gguf_name} holds {data.size} bytes per "
                                             f"{'expert' if expert is not None else 'tensor'}, not {out.numel()}")
        self._read_into(tensor, expert, out.numpy())

    def _read_into(self, tensor, expert: int | None, out: np.ndarray) -> None:
        """Tensor `tensor`'s bytes (or one expert's slice) into `out` with a plain read. Never through the reader's
        memory map: every page of it that is touched counts in the process's resident memory until the map
        closes, so reading through it held a second copy of everything read until the end of the load."""
        offset = tensor.data_offset + (0 if expert is None else expert * out.nbytes)
        part = self._reader.part_of[tensor.name]
        if part not in self._files:
            self._files[part] = open(self._reader.paths[part], "rb", buffering=0)
        file = self._files[part]
        file.seek(offset)
        view = memoryview(out).cast("B")
        if file.readinto(view) != len(view):
            raise CheckpointError(self._reader.paths[part], f"truncated GGUF file: tensor {tensor.name} ends past "
                                                            f"the file's end")

    @property
    def parts(self) -> tuple[Path, ...]:
        """The files the model is in: the GGUF, or a split GGUF's parts, the first first."""
        return tuple(Path(p) for p in self._reader.paths)

    @property
    def header(self):
        """The metadata and tensor infos as read (`fields`, `tensors`; a split GGUF's parts joined)."""
        return self._reader

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _read(self, tensor, expert: int | None) -> torch.Tensor:
        """Read (and dequantize) one GGUF tensor, or one expert's slice of a stacked one."""
        mapped = tensor.data if expert is None else tensor.data[expert]  # its dtype and shape; nothing is read
        if self._fetched:
            data = np.array(mapped)
        else:
            data = np.empty(mapped.shape, dtype=mapped.dtype)
            self._read_into(tensor, expert, data)
        shape = [int(d) for d in reversed(tensor.shape)][0 if expert is None else 1:]
        qtype = tensor.tensor_type
        if qtype == GGMLQuantizationType.BF16:  # numpy has no bfloat16: the reader hands out raw bytes
            return torch.from_numpy(data).view(torch.bfloat16).reshape(shape)
        if data.dtype != np.uint8:  # F32, F16, F64 and integer types come typed
            return torch.from_numpy(data).reshape(shape)
        try:
            values = dequantize(data, qtype)
        except NotImplementedError:
            raise CheckpointError(self.path, f"tensor {tensor.name} is of type {qtype.name}, which the gguf "
                                             f"package cannot dequantize") from None
        return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape)

    # tokenizer ---------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> tokenizers.Tokenizer | None:
        """The vocabulary rebuilt as a `tokenizers.Tokenizer`; None when the file has none."""
        model = self._meta("tokenizer.ggml.model", str, None)
        if model is None:
            return None
        tokens = self._meta("tokenizer.ggml.tokens", list)
        types = self._meta("tokenizer.ggml.token_type", list, [TokenType.NORMAL] * len(tokens))
        if model == "gpt2":
            tok = _byte_level_bpe(tokens, self._meta("tokenizer.ggml.merges", list),
                                  self._meta("tokenizer.ggml.pre", str, "default"))
        elif model == "llama":
            unknown = self._meta("tokenizer.ggml.unknown_token_id", int, None)
            tok = _sentencepiece_bpe(tokens, self._meta("tokenizer.ggml.scores", list),
                                     tokens[unknown] if unknown is not None else None,
                                     self._meta("tokenizer.ggml.add_space_prefix", bool, True))
        else:
            raise UnsupportedModelError(self.path, f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        _add_special_tokens(tok, tokens, types)
        return tok

    @property
    def generation_defaults(self) -> dict:
        """The sampling the file recommends (engine.load.generation_defaults); a value of the wrong type is ignored."""
        from moedesk.engine.load.generation_defaults import from_gguf_metadata

        def get(key):
            field = self._reader.fields.get(key)
            return field.contents() if field is not None else None

        return from_gguf_metadata(get)

    @property
    def tokenizer_config(self) -> dict:
        tokens = self._meta("tokenizer.ggml.tokens", list, [])
        model = self._meta("tokenizer.ggml.model", str, None)

        def token(key):
            index = self._meta(f"tokenizer.ggml.{key}", int, None)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        config = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
            "add_bos_token": self._meta("tokenizer.ggml.add_bos_token", bool, model == "llama"),
        }
        if (template := self._meta("tokenizer.chat_template", str, None)) is not None:
            config["chat_template"] = template
        return config


def _open_reader(path: Path) -> GGUFReader:
    """GGUFReader, with whatever it raises on a bad file turned into one line about the file."""
    try:
        return GGUFReader(path)
    except OSError as e:
        raise CheckpointError(path, f"cannot read the file ({e.strerror or e})") from None
    except Exception as e:  # ValueError, IndexError, numpy errors: the reader validates by failing
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"GGUF":
            raise CheckpointError(path, "not a GGUF file (bad magic)" if head else "empty file") from None
        _check_header(path)  # says which tensor or key is wrong, where the reader's own error rarely does
        detail = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise CheckpointError(path, f"truncated or corrupt GGUF file ({detail})") from None


def _check_header(path: Path) -> None:
    """Raise the header parser's one line (engine.load.gguf_header) for a file GGUFReader could not read, if it
    finds what is wrong; return quietly if it does not."""
    import mmap

    from moedesk.engine.load.gguf_header import HeaderIncomplete, parse_header

    problem = None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                parse_header(data, path)
            except HeaderIncomplete:
                problem = "truncated GGUF file: its header runs past the file's end"
            except CheckpointError as e:
                problem = e.problem  # only the text: the error's frames hold views of the map, which must close
    except (OSError, ValueError, BufferError):
        return
    if problem is not None:
        raise CheckpointError(path, problem)


def _undo_rope_permutation(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved pairs (r0, r_half, r1, r_half+1, ...); the
    Hub stores the first half then the second half. Undo it (works for biases too)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    # Tokens as the file spells them: normal ones in GPT-2's byte alphabet, added ones (control,
    # user-defined) as raw text, which is how they are matched in text and shown when decoded.
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3's tokenizer takes a word that is itself a token whole, before any merge (llama.cpp
    # sets the same flag for these vocabularies).
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE))
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # "gpt2", "default" and names we do not know: GPT-2's own split, as transformers does
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk: str | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: the pair whose joined piece scores highest merges
    first, text falls back to <0xXX> byte tokens, spaces are ▁, and every run of text (at the start
    and after each special token) gets a leading space when add_space_prefix is set."""
    vocab = {t: i for i, t in enumerate(tokens)}
    # GGUF stores no merges for these vocabularies: every way to cut a piece in two known pieces is a
    # merge, ranked by the score of the piece it makes.
    merges = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[piece], vocab[left], left, right))
    merges.sort()
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges],
                                          unk_token=unk, fuse_unk=True, byte_fallback=True))
    # A normalizer, not Metaspace: it runs on every piece of text between added tokens, which is
    # where llama.cpp prepends its space too.
    spaces = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if add_space_prefix else []) + spaces)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def _add_special_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added
    tokens: both are then matched whole in text, as llama.cpp does, and keep their own ids. User-
    defined tokens (<think>, <tool_call>) stay non-special, as in the models' tokenizer.json, so
    decoding with skip_special_tokens keeps them."""
    special = [t for t, kind in zip(tokens, types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user = [t for t, kind in zip(tokens, types) if kind == TokenType.USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
