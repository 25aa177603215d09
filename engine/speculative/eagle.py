"""The EAGLE draft head: one decoder layer that predicts the target's next feature, and so its next token.

EAGLE (Li et al.) drafts from the target's own features rather than with a separate small model.
Row t of a draft forward pairs a feature of the target at position t with the embedding of the token
at position t+1; the head's output at that row stands for the target's feature at t+1, and a
language-model head turns it into the draft for the token at t+2. Drafting further feeds the head's
own output back in as the next row's feature. The row's RoPE position is t (the head numbers its own
rows from 0, one per target position).

Two published layouts, told apart by their tensor names:

EAGLE-1 and EAGLE-2 (tensors fc.*, layers.0.*, optionally embed_tokens.weight):
    h   = fc([embed(token) ; feature])            2d -> d, with bias (config "bias", default true)
    h  += attn(h)                                  layer 0 has no input norm
    h  += mlp(post_attention_layernorm(h))
    logits = target_lm_head(h)                     the target's own LM head, no final norm
  The feature is the target's last hidden state after its final norm (the input of its LM head),
  and for later draft steps the head's own output h. EAGLE-2 only changes how the tree is drafted;
  its heads for Qwen2 add q/k/v biases (config "qkv_bias").

EAGLE-3 (tensors fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d):
    h   = fc(feature)                              3·d_target -> d, no bias; skipped when the
                                                   feature is the head's own output (width d)
    x   = [input_layernorm(embed(token)) ; hidden_norm(h)]          2d wide
    h  += attn(x)                                  q/k/v take 2d inputs
    h  += mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                      over a draft vocabulary; draft id i is target
                                                   id i + d2t[i]; t2d marks target ids drafted
  The feature is the concatenation of the residual stream entering the target's layers 2, L//2 and
  L-3 (`eagle3_feature_layers`), in that order.

Attention is Llama's: RoPE on q and k (engine.model's tables and rotation), grouped key/value heads,
softmax over what the mask allows. The head keeps its own KV cache (`DraftCache`); each forward
appends its rows to it, and attends under a mask the caller gives (a draft tree: each node sees the
accepted prefix and its ancestors) or, by default, causally.

Weights load from a folder with config.json and model.safetensors or pytorch_model.bin; a .bin is
read only through torch.load(weights_only=True), so a file holding anything but tensors is refused.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.engine import json_read
from moedesk.engine.model.architectures import _parse_rope
from moedesk.engine.model.config import RopeConfig
from moedesk.engine.model.embedding import rows, shared_table
from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.model.norm import RMSNorm
from moedesk.engine.model.transformer import MLP, apply_rope, rope_inv_freq


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input (the residual stream entering them) EAGLE-3 concatenates."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class EagleConfig:
    version: int  # 1: the EAGLE-1/2 layout; 3: EAGLE-3
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary (the embedding's rows)
    draft_vocab_size: int  # EAGLE-3's own LM head; equals vocab_size for EAGLE-1/2
    target_hidden_size: int
    fc_bias: bool = True
    qkv_bias: bool = False
    rope: RopeConfig = RopeConfig()

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head takes."""
        return self.target_hidden_size * (3 if self.version == 3 else 1)


class DraftCache:
    """The head's keys and values: [B, kv_heads, capacity, head_dim], the first `length` slots used."""

    def __init__(self, batch: int, capacity: int, cfg: EagleConfig, dtype=torch.float32, device="cpu"):
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, kv_heads, T, head_dim] into the next T slots."""
        t = k.shape[2]
        if self.length + t > self.capacity:
            raise RuntimeError(f"draft cache full: {self.length} + {t} slots > capacity {self.capacity}")
        self.keys[:, :, self.length:self.length + t] = k
        self.values[:, :, self.length:self.length + t] = v
        self.length += t

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, slots: torch.Tensor, start: int) -> None:
        """Move the entries at `slots` [B, n] (e.g. a tree's accepted nodes) to start..start+n and drop
        everything after them. The gather copies first, so slots may overlap the destination."""
        n = slots.shape[1]
        index = slots[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        k, v = self.keys.gather(2, index), self.values.gather(2, index)
        self.keys[:, :, start:start + n] = k
        self.values[:, :, start:start + n] = v
        self.length = start + n


class _Attention(nn.Module):
    def __init__(self, cfg: EagleConfig, in_features: int):
        super().__init__()
        self.cfg = cfg
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wq = nn.Linear(in_features, q_out, bias=cfg.qkv_bias)
        self.wk = nn.Linear(in_features, kv_out, bias=cfg.qkv_bias)
        self.wv = nn.Linear(in_features, kv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # From the positions, not a table, so a draft may run at any position (float32, as the
        # reference builds its tables, then cast).
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x, positions, cache: DraftCache, mask: torch.Tensor | None):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, cfg.num_heads, cfg.head_dim)
        k = self.wk(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.wv(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = self.rope(positions, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = cache.length
        cache.append(k.transpose(1, 2).to(cache.keys.dtype), v.transpose(1, 2).to(cache.values.dtype))
        keys, values = cache.keys[:, :, :cache.length].to(x.dtype), cache.values[:, :, :cache.length].to(x.dtype)
        if mask is None:
            slot = torch.arange(cache.length, device=x.device)
            mask = (slot[None, :] <= (start + torch.arange(t, device=x.device))[:, None]).expand(b, t, -1)
        elif mask.shape[-1] != cache.length:
            raise ValueError(f"mask covers {mask.shape[-1]} cache slots; the cache holds {cache.length} after this step")
        groups = cfg.num_heads // cfg.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1))
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class EagleHead(nn.Module):
    """An EAGLE draft head. `embed` (the token embedding, [vocab, d]) comes from the checkpoint or the
    target; `target_lm_head` ([vocab, d], the target's) is needed by EAGLE-1/2 heads, which have none
    of their own. Both are held as buffers that are not saved, so they can share the target's tensors."""

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor | None = None, target_lm_head: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        three = cfg.version == 3
        self.fc = nn.Linear(cfg.feature_size if three else 2 * d, d, bias=cfg.fc_bias and not three)
        self.attn = _Attention(cfg, 2 * d if three else d)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)
        if three:
            self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        self._target_head: tuple[nn.Module, ...] = ()  # a packed target head, run as is (`share_target_head`)

    def share_target_head(self, lm_head: nn.Module) -> None:
        """The target's LM head for an EAGLE-1/2 head, shared where it lives: a Linear's weight as the matrix; a
        packed one (engine.model.packed_linear) through its own forward, with no 16-bit copy of the whole head
        beside what the GPU budget holds. Kept in a tuple, so that moving or saving this head leaves it alone."""
        if hasattr(lm_head, "packed"):
            self.target_lm_head, self._target_head = None, (lm_head,)
        else:
            self.target_lm_head, self._target_head = lm_head.weight.detach(), ()

    def new_cache(self, batch: int, capacity: int) -> DraftCache:
        return DraftCache(batch, capacity, self.cfg, self.fc.weight.dtype, self.fc.weight.device)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
                mask: torch.Tensor | None = None, from_target: bool = True) -> torch.Tensor:
        """tokens [B, T], features [B, T, F], positions [B, T] -> the head's hidden states [B, T, d].

        `mask` [B, T, cache.length + T] (True: may attend) covers the cache after this step's rows are
        appended; None attends causally. `from_target`: the features are the target's (EAGLE-3 runs
        them through fc) rather than the head's own outputs (which it takes as they are).
        """
        if self.embed is None:
            raise RuntimeError("the EAGLE head has no token embedding: load it with the target's")
        dtype = self.fc.weight.dtype
        emb = rows(self.embed, tokens).to(dtype)  # the target's table read where it lies
        features = features.to(dtype)
        if self.cfg.version == 3:
            h = self.fc(features) if from_target else features
            x = torch.cat([self.embed_norm(emb), self.hidden_norm(h)], dim=-1)
        else:
            h = self.fc(torch.cat([emb, features], dim=-1))
            x = h
        h = h + self.attn(x, positions, cache, mask)
        return h + self.mlp(self.mlp_norm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits: over the target's vocabulary (EAGLE-1/2) or the draft vocabulary (EAGLE-3;
        `to_target_ids` maps its ids)."""
        if self.cfg.version == 3:
            return self.lm_head(self.norm(hidden))
        if self._target_head:
            packed = self._target_head[0]
            return packed(hidden.to(packed.packed.device)).to(hidden.device)
        if self.target_lm_head is None:
            raise RuntimeError("an EAGLE-1/2 head needs the target's LM head")
        head = self.target_lm_head
        # The target's head is shared where it lives (a spread's last GPU): the rows go there, the logits come back.
        return F.linear(hidden.to(head.device), head.to(hidden.dtype)).to(hidden.device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.version != 3:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits spread over the target's vocabulary (-inf where the draft cannot propose), the
        form rejection sampling needs."""
        logits = self.logits(hidden)
        if self.cfg.version != 3 or self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return logits
        ids = self.to_target_ids(torch.arange(self.cfg.draft_vocab_size, device=logits.device))
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy(-1, ids, logits)


# --- checkpoints ------------------------------------------------------------------------------

# checkpoint tensor name -> module name, per layout (q/k/v biases and fc.bias only where present)
_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _names(cfg: EagleConfig) -> dict[str, str]:
    layer = "midlayer" if cfg.version == 3 else "layers.0"
    names = {"fc.weight": "fc.weight"}
    if cfg.fc_bias and cfg.version != 3:
        names["fc.bias"] = "fc.bias"
    for theirs, ours in _ATTN.items():
        names[f"{layer}.self_attn.{theirs}.weight"] = f"attn.{ours}.weight"
        if cfg.qkv_bias and theirs != "o_proj":
            names[f"{layer}.self_attn.{theirs}.bias"] = f"attn.{ours}.bias"
    for theirs, ours in _MLP.items():
        names[f"{layer}.mlp.{theirs}.weight"] = f"mlp.{ours}.weight"
    names[f"{layer}.post_attention_layernorm.weight"] = "mlp_norm.weight"
    if cfg.version == 3:
        names.update({"midlayer.input_layernorm.weight": "embed_norm.weight",
                      "midlayer.hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
                      "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d"})
    return names


# Present in some published heads and unused by the EAGLE code that runs them: layer 0's input norm
# (EAGLE-1/2 never create it) and rotary tables saved as buffers.
_IGNORED_SUFFIXES = ("layers.0.input_layernorm.weight", "rotary_emb.inv_freq")


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    st, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(st)), st
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(st, f"cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    if binary.is_file():
        try:
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(binary, "holds pickled objects other than tensors; refused "
                                          "(only plain tensor .bin files load, with torch.load(weights_only=True))") from None
        except (RuntimeError, EOFError, OSError) as e:
            raise CheckpointError(binary, f"cannot be read ({str(e).splitlines()[0]})") from None
        if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise CheckpointError(binary, "is not a mapping of tensor names to tensors")
        return tensors, binary
    raise CheckpointError(folder, "no model.safetensors or pytorch_model.bin for the EAGLE head")


def _config(hf: dict, tensors: dict[str, torch.Tensor], path: Path) -> EagleConfig:
    if any(k.startswith("midlayer.") for k in tensors):
        version = 3
    elif any(k.startswith("layers.0.") for k in tensors):
        version = 1
    else:
        raise UnsupportedModelError(path, "neither EAGLE-1/2 tensors (layers.0.*) nor EAGLE-3 tensors (midlayer.*)")
    if any(k.startswith("layers.") and not k.startswith("layers.0.") for k in tensors):
        raise UnsupportedModelError(path, "an EAGLE head of more than one decoder layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(path, f"hidden_act {hf['hidden_act']!r} (EAGLE heads here use silu)")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        cfg = EagleConfig(
            version=version, hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            vocab_size=int(hf["vocab_size"]), draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
            target_hidden_size=int(hf.get("target_hidden_size") or hidden),
            fc_bias="fc.bias" in tensors, qkv_bias=any(k.endswith("self_attn.q_proj.bias") for k in tensors),
            rope=_parse_rope(hf, path))
    except KeyError as e:
        raise CheckpointError(path, f"config.json lacks {e.args[0]!r}") from None
    return cfg


def load_eagle_head(folder, target_embed: torch.Tensor | None = None, target_lm_head: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device="cpu") -> EagleHead:
    """An EAGLE head from `folder`. The target's embedding is used where the checkpoint has none."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        hf = json_read.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(config_path, "missing (an EAGLE head folder needs config.json)") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(config_path, f"is not valid JSON ({e})") from None
    tensors, weights_path = _read_tensors(folder)
    cfg = _config(hf, tensors, weights_path)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        embed = target_embed
    if embed is None:
        raise CheckpointError(weights_path, "has no embed_tokens.weight; load the head with the target's embedding")
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(weights_path, f"token embedding is {tuple(embed.shape)}, expected "
                                            f"({cfg.vocab_size}, {cfg.hidden_size}) from config.json")
    head = EagleHead(cfg)
    names = _names(cfg)
    if cfg.version == 3 and cfg.draft_vocab_size == cfg.vocab_size and "lm_head.weight" in tensors:
        # over the whole vocabulary the map may be left out (vLLM refuses one there); a permuted one is undone, so
        # that such a head's draft ids are target ids (target_vocab_logits counts on it)
        tensors.setdefault("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise CheckpointError(weights_path, f"missing tensor {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unknown = sorted(k for k in tensors if k not in names and not k.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise UnsupportedModelError(weights_path, f"unexpected tensor {unknown[0]}" + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""))
    state = head.state_dict()
    for theirs, ours in names.items():
        if tuple(tensors[theirs].shape) != tuple(state[ours].shape):
            raise CheckpointError(weights_path, f"{theirs} is {tuple(tensors[theirs].shape)}, expected "
                                                f"{tuple(state[ours].shape)} from config.json")
        state[ours] = tensors[theirs]
    if cfg.version == 3:
        # drafting scatters draft id i's logit to target id i + d2t[i]: each must be a target id, and a different one
        ids = torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(ids.unique()) != len(ids)):
            raise CheckpointError(weights_path, "d2t maps a draft id outside the target's vocabulary or two draft ids "
                                                "to one target id (draft id i is target id i + d2t[i])")
        if cfg.draft_vocab_size == cfg.vocab_size and bool(state["d2t"].any()):
            # a permuted whole vocabulary: draft ids made target ids, as target_vocab_logits takes them
            state.update(whole_vocabulary_in_target_order(state))
    head.load_state_dict(state)
    head.to(device=device, dtype=dtype)  # buffers d2t/t2d keep their integer/bool dtypes
    head.embed = shared_table(embed, device, dtype)
    if target_lm_head is not None:
        head.target_lm_head = target_lm_head.to(device)
    return head


def whole_vocabulary_in_target_order(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lm_head.weight with row i at target id i + d2t[i], and the identity d2t, for a head over the whole
    vocabulary (each target id once: checked by the caller or by load_eagle_head)."""
    target_ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()
    lm_head = tensors["lm_head.weight"]
    return {"lm_head.weight": torch.empty_like(lm_head).index_copy_(0, target_ids, lm_head),
            "d2t": torch.zeros_like(tensors["d2t"])}


def checkpoint_tensors(head: EagleHead, with_embedding: bool = True) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names (what `save_eagle_head` writes)."""
    state = head.state_dict()
    out = {theirs: state[ours].detach().contiguous() for theirs, ours in _names(head.cfg).items()}
    if with_embedding and head.embed is not None:
        out["embed_tokens.weight"] = head.embed.detach().contiguous()
    return out


def config_dict(cfg: EagleConfig) -> dict:
    """config.json for a head (the fields `load_eagle_head` reads)."""
    hf = {"architectures": ["LlamaForCausalLMEagle3" if cfg.version == 3 else "LlamaForCausalLM"],
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
          "hidden_act": "silu", "bias": cfg.fc_bias, "rope_theta": cfg.rope.theta}
    if cfg.rope.kind != "default":
        hf["rope_scaling"] = {"rope_type": cfg.rope.kind, "factor": cfg.rope.factor,
                              "low_freq_factor": cfg.rope.low_freq_factor, "high_freq_factor": cfg.rope.high_freq_factor,
                              "original_max_position_embeddings": cfg.rope.original_max_position_embeddings}
    if cfg.version == 3:
        hf.update(draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size)
    return hf


def save_eagle_head(head: EagleHead, folder, fmt: str = "safetensors", with_embedding: bool = True) -> Path:
    """Write config.json and model.safetensors (or, fmt="bin", a plain tensor pytorch_model.bin)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict(head.cfg), indent=2))
    tensors = checkpoint_tensors(head, with_embedding)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(tensors, str(folder / "model.safetensors"))
    elif fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return folder
