"""The EAGLE draft head (engine.speculative.eagle) against references, on random weights.

EAGLE-1/2: against the EAGLE project's own model code (`eagle.model.cnets.Model` of the eagle-llm
package) where that package is importable — its pinned dependencies clash with this project's
test extras, so it is not one of them; install it with `pip install --no-deps eagle-llm` — and
always against a composition of transformers' LlamaDecoderLayer that follows the published code
(fc over [embedding ; feature], layer 0 without its input norm, the target's LM head, no final norm).

EAGLE-3: against a composition of transformers' Llama attention, RMSNorm and MLP in the layout the
EAGLE project and SpecForge publish (fc over three target hidden states; the embedding and the
hidden state each normalised and concatenated into a 2x-wide attention input; a final norm and the
head's own LM head over a draft vocabulary mapped to target ids by d2t).

The references recompute every row from scratch under the full mask; the head runs incrementally
with its own KV cache, so agreement also checks the cache and the masks.
"""
import json
import warnings

import pytest
import torch
from torch import nn

from moedesk.engine.errors import CheckpointError, MoedeskError
from moedesk.engine.speculative import eagle
from moedesk.engine.speculative.eagle import EagleConfig, EagleHead, load_eagle_head, save_eagle_head

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding)

VOCAB = 50
EAGLE1 = EagleConfig(version=1, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=64)
# EAGLE-3 with a head_dim that is not hidden/heads, a target wider than the head, a smaller draft vocabulary
EAGLE3 = EagleConfig(version=3, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=32,
                     rms_norm_eps=1e-5, vocab_size=VOCAB, draft_vocab_size=20, target_hidden_size=48,
                     fc_bias=False)


def random_head(cfg: EagleConfig, seed=0) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.1
    head = EagleHead(cfg, embed=embed, target_lm_head=lm_head if cfg.version != 3 else None)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))  # not ones: a skipped norm shows
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if cfg.version == 3:
            ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
            head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
            head.t2d.zero_()
            head.t2d[ids] = True
    return head.eval()


def llama_config(cfg: EagleConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=512, rope_theta=cfg.rope.theta,
                       attn_implementation="eager")


def additive(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, S] (True: may attend) -> the additive [1, 1, T, S] mask transformers' eager attention takes."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]


class Eagle1Reference(nn.Module):
    """fc + a transformers LlamaDecoderLayer whose input norm is removed, as EAGLE-1/2 build layer 0."""

    def __init__(self, head: EagleHead):
        super().__init__()
        lc = llama_config(head.cfg)
        self.fc = nn.Linear(2 * lc.hidden_size, lc.hidden_size, bias=head.cfg.fc_bias)
        self.layer = LlamaDecoderLayer(lc, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(lc)
        tensors = eagle.checkpoint_tensors(head)
        self.embed = tensors.pop("embed_tokens.weight")
        self.lm_head = head.target_lm_head
        for name, t in tensors.items():
            target = self.fc if name.startswith("fc.") else self.layer
            key = name.split(".", 1)[1] if name.startswith("fc.") else name.removeprefix("layers.0.")
            target.get_parameter(key).data.copy_(t)

    def forward(self, tokens, features, positions, mask):
        h = self.fc(torch.cat([self.embed[tokens], features], dim=-1))
        cos_sin = self.rotary(h, positions[None])
        return self.layer(h, attention_mask=additive(mask), position_ids=positions[None], position_embeddings=cos_sin)


class Eagle3Reference(nn.Module):
    """The EAGLE-3 midlayer from transformers' parts: LlamaAttention with 2x-wide q/k/v inputs."""

    def __init__(self, head: EagleHead):
        super().__init__()
        cfg = head.cfg
        lc = llama_config(cfg)
        d = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, d, bias=False)
        self.self_attn = LlamaAttention(lc, layer_idx=0)
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)):
            setattr(self.self_attn, proj, nn.Linear(2 * d, heads * cfg.head_dim, bias=False))
        self.input_layernorm = LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(lc)
        self.norm = LlamaRMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(lc)
        tensors = eagle.checkpoint_tensors(head)
        self.embed = tensors.pop("embed_tokens.weight")
        self.d2t = tensors.pop("d2t")
        tensors.pop("t2d")
        for name, t in tensors.items():
            self.get_parameter(name.removeprefix("midlayer.")).data.copy_(t)

    def forward(self, tokens, inputs, positions, mask, from_target):
        """inputs: per row a target feature (3 x target width, through fc) or the head's own output."""
        h = torch.stack([self.fc(x) if t else x for x, t in zip(inputs, from_target)])[None]
        x = torch.cat([self.input_layernorm(self.embed[tokens]), self.hidden_norm(h)], dim=-1)
        cos_sin = self.rotary(h, positions[None])
        a, _ = self.self_attn(x, position_embeddings=cos_sin, attention_mask=additive(mask))
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, h):
        return self.lm_head(self.norm(h))


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def _draft_steps(head, ref_forward, feature_width, tree_from_target=True):
    """Prefill 5 rows, one chain step on the head's own output, then a 3-node tree (one root child
    with two children of its own... as siblings: nodes a, b under the last row, c under a); compare
    every row with the reference's recomputation under the full mask."""
    g = torch.Generator().manual_seed(1)
    cache = head.new_cache(1, 16)
    tokens = torch.randint(0, VOCAB, (1, 5), generator=g)
    feats = torch.randn(1, 5, feature_width, generator=g)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        out = head(tokens, feats, positions, cache)
        all_tokens, rows, all_pos, from_target = tokens[0].tolist(), list(feats[0]), list(range(5)), [True] * 5
        ref = ref_forward(torch.tensor(all_tokens), rows, torch.tensor(all_pos), _causal(5), from_target)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)

        # chain step: the next token with the head's own last output as its feature
        tok = torch.randint(0, VOCAB, (1, 1), generator=g)
        step = head(tok, out[:, -1:], torch.tensor([[5]]), cache, from_target=False)
        all_tokens.append(int(tok)), rows.append(out[0, -1]), all_pos.append(5), from_target.append(False)
        ref = ref_forward(torch.tensor(all_tokens), rows, torch.tensor(all_pos), _causal(6), from_target)
        torch.testing.assert_close(step[0, -1], ref[0, -1], rtol=1e-5, atol=1e-5)

        # tree: nodes a, b (siblings at position 6, both fed the chain step's output) and c (child of a)
        tree_tokens = torch.randint(0, VOCAB, (1, 3), generator=g)
        tree_feats = torch.stack([step[0, -1], step[0, -1], step[0, -1] * 0.5])[None]
        tree_pos = torch.tensor([[6, 6, 7]])
        tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree], dim=1)
        nodes = head(tree_tokens, tree_feats, tree_pos, cache, mask=mask[None], from_target=False)
        full = torch.zeros(9, 9, dtype=torch.bool)
        full[:6, :6] = _causal(6)
        full[6:] = mask
        ref = ref_forward(torch.tensor(all_tokens + tree_tokens[0].tolist()), rows + list(tree_feats[0]),
                          torch.tensor(all_pos + [6, 6, 7]), full, from_target + [False] * 3)
        torch.testing.assert_close(nodes[0], ref[0, 6:], rtol=1e-5, atol=1e-5)

        # accept node a then c: keep their cache slots (6 and 8) after the prefix, then go on
        cache.keep(torch.tensor([[6, 8]]), start=6)
        assert cache.length == 8
        tok = torch.randint(0, VOCAB, (1, 1), generator=g)
        after = head(tok, nodes[:, 2:3], torch.tensor([[8]]), cache, from_target=False)
        kept = all_tokens + [int(tree_tokens[0, 0]), int(tree_tokens[0, 2]), int(tok)]
        ref = ref_forward(torch.tensor(kept), rows + [tree_feats[0, 0], tree_feats[0, 2], nodes[0, 2]],
                          torch.tensor(all_pos + [6, 7, 8]), _causal(9), from_target + [False] * 4)
        torch.testing.assert_close(after[0, -1], ref[0, -1], rtol=1e-5, atol=1e-5)
    return out


def test_eagle1_head_equals_a_transformers_llama_layer_without_input_norm():
    head = random_head(EAGLE1)
    ref = Eagle1Reference(head).eval()

    def ref_forward(tokens, rows, positions, mask, from_target):
        return ref(tokens[None], torch.stack(rows)[None], positions, mask)

    out = _draft_steps(head, ref_forward, EAGLE1.hidden_size)
    # logits are the target's LM head on the output, no final norm
    torch.testing.assert_close(head.logits(out), out @ head.target_lm_head.T)


def _eagle_llm_model(cfg: EagleConfig):
    cnets = pytest.importorskip("eagle.model.cnets", reason="eagle-llm is not installed (pip install --no-deps eagle-llm)")
    from eagle.model.configs import EConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        econfig = EConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                          num_hidden_layers=1, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                          rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=512, pad_token_id=0)
        econfig.rope_scaling = None  # transformers >= 5 fills in a dict the 1.x code reads as a scaling type
    return cnets.Model(econfig, bias=cfg.fc_bias).eval()


def test_eagle1_head_equals_the_eagle_projects_model_code(tmp_path):
    reference = _eagle_llm_model(EAGLE1)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 and p.shape[0] == 64 else 0.0))
    # its state dict is an EAGLE-1 checkpoint: load it through our loader, by the published names
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "hidden_act": "silu", "bias": True}))
    head = load_eagle_head(tmp_path).eval()
    g = torch.Generator().manual_seed(3)
    feats, tokens = torch.randn(1, 5, 64, generator=g), torch.randint(0, VOCAB, (1, 5), generator=g)
    cache = head.new_cache(1, 16)
    with torch.no_grad():
        ours = head(tokens, feats, torch.arange(5)[None], cache)
        theirs, kv = reference(feats, input_ids=tokens, use_cache=True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # a chain step with the cache
        tok = torch.randint(0, VOCAB, (1, 1), generator=g)
        ours = head(tok, ours[:, -1:], torch.tensor([[5]]), cache, from_target=False)
        theirs, kv = reference(theirs[:, -1:], input_ids=tok, past_key_values=kv, use_cache=True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # a tree step: EAGLE's own tree mask and positions (node 2 is a child of node 0)
        tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]])
        toks = torch.randint(0, VOCAB, (1, 3), generator=g)
        feats3 = ours.expand(1, 3, 64).clone()
        reference.tree_mask = tree[None, None]
        theirs, kv = reference(feats3, input_ids=toks, past_key_values=kv, position_ids=torch.tensor([6, 6, 7]),
                               use_cache=True)
        reference.tree_mask = None
        mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree.bool()], dim=1)[None]
        ours = head(toks, feats3, torch.tensor([[6, 6, 7]]), cache, mask=mask, from_target=False)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_eagle3_head_equals_the_published_midlayer_layout():
    head = random_head(EAGLE3)
    ref = Eagle3Reference(head).eval()

    def ref_forward(tokens, rows, positions, mask, from_target):
        return ref(tokens[None], rows, positions, mask, from_target)

    out = _draft_steps(head, ref_forward, 3 * EAGLE3.target_hidden_size)
    torch.testing.assert_close(head.logits(out), ref.logits(out), rtol=1e-5, atol=1e-5)
    # draft ids map to target ids through d2t offsets; the spread logits put -inf elsewhere
    draft_ids = head.logits(out).argmax(-1)
    target_ids = head.to_target_ids(draft_ids)
    assert torch.equal(target_ids, draft_ids + ref.d2t[draft_ids])
    assert bool(head.t2d[target_ids].all())
    spread = head.target_vocab_logits(out)
    assert spread.shape[-1] == VOCAB
    assert torch.equal(spread.argmax(-1), target_ids)
    assert bool(torch.isinf(spread[..., ~head.t2d]).all())


def test_eagle3_feature_layers():
    assert eagle.eagle3_feature_layers(48) == (2, 24, 45)  # Qwen3-30B-A3B
    assert eagle.eagle3_feature_layers(16) == (2, 8, 13)  # OLMoE


def test_batched_rows_with_padding_equal_each_row_alone():
    head = random_head(EAGLE1, seed=4)
    g = torch.Generator().manual_seed(5)
    tokens, feats = torch.randint(0, VOCAB, (2, 4), generator=g), torch.randn(2, 4, 64, generator=g)
    positions = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 2]])  # row 1: a padding slot, then positions 0..2
    # row 1 is one token shorter: its first slot is padding that nothing may see
    mask = _causal(4).expand(2, 4, 4).clone()
    mask[1, :, 0] = False
    mask[1, 0, 0] = True  # the padding row attends to itself only, so softmax has something
    with torch.no_grad():
        both = head(tokens, feats, positions, head.new_cache(2, 8), mask=mask)
        alone0 = head(tokens[:1], feats[:1], positions[:1], head.new_cache(1, 8))
        alone1 = head(tokens[1:, 1:], feats[1:, 1:], torch.arange(3)[None], head.new_cache(1, 8))
    torch.testing.assert_close(both[0], alone0[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1, 1:], alone1[0], rtol=1e-5, atol=1e-5)


# --- loading ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("cfg", [EAGLE1, EAGLE3], ids=["eagle1", "eagle3"])
def test_save_and_load_round_trip(tmp_path, cfg, fmt):
    head = random_head(cfg, seed=6)
    save_eagle_head(head, tmp_path, fmt=fmt)
    loaded = load_eagle_head(tmp_path, target_lm_head=head.target_lm_head).eval()
    assert loaded.cfg == head.cfg
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    g = torch.Generator().manual_seed(7)
    tokens, feats = torch.randint(0, VOCAB, (1, 4), generator=g), torch.randn(1, 4, cfg.feature_size, generator=g)
    with torch.no_grad():
        a = head(tokens, feats, torch.arange(4)[None], head.new_cache(1, 8))
        b = loaded(tokens, feats, torch.arange(4)[None], loaded.new_cache(1, 8))
    assert torch.equal(a, b) and torch.equal(head.logits(a), loaded.logits(b))


def test_embedding_comes_from_the_target_when_the_head_has_none(tmp_path):
    head = random_head(EAGLE1, seed=8)
    save_eagle_head(head, tmp_path, with_embedding=False)
    with pytest.raises(CheckpointError, match="no embed_tokens"):
        load_eagle_head(tmp_path)
    loaded = load_eagle_head(tmp_path, target_embed=head.embed, target_lm_head=head.target_lm_head)
    assert torch.equal(loaded.embed, head.embed)
    with pytest.raises(CheckpointError, match="token embedding is"):
        load_eagle_head(tmp_path, target_embed=head.embed[:, :10])


class Payload:
    """Any object that is not a tensor: what a malicious pickle would smuggle in."""


def test_a_pickled_object_in_a_bin_is_refused_with_one_line(tmp_path):
    head = random_head(EAGLE1)
    save_eagle_head(head, tmp_path, fmt="bin")
    tensors = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    tensors["extra"] = Payload()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(MoedeskError) as err:
        load_eagle_head(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "pytorch_model.bin" in message and "pickled" in message


def test_unusable_checkpoints_are_refused_with_one_line(tmp_path):
    head = random_head(EAGLE1)
    save_eagle_head(head, tmp_path)
    cases = []
    config = json.loads((tmp_path / "config.json").read_text())
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))

    def expect(match, tensors=tensors, config=config):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(MoedeskError, match=match) as err:
            load_eagle_head(tmp_path)
        assert "\n" not in str(err.value)
        cases.append(match)

    expect("missing tensor layers.0.mlp.up_proj.weight", {k: v for k, v in tensors.items() if "up_proj" not in k})
    expect("more than one decoder layer", {**tensors, "layers.1.mlp.up_proj.weight": tensors["layers.0.mlp.up_proj.weight"].clone()})
    expect("unexpected tensor something", {**tensors, "something": torch.zeros(1)})
    expect("fc.weight is", {**tensors, "fc.weight": torch.zeros(64, 100)})
    expect("hidden_act", config={**config, "hidden_act": "gelu"})
    expect("lacks 'hidden_size'", config={k: v for k, v in config.items() if k != "hidden_size"})
    expect("neither EAGLE-1/2", {"fc.weight": tensors["fc.weight"]})
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_eagle_head(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        load_eagle_head(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_eagle_head(tmp_path)
    # layer 0's input norm, which some EAGLE-1 heads carry and EAGLE never uses, is ignored
    save_eagle_head(head, tmp_path)
    save_file({**tensors, "layers.0.input_layernorm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    load_eagle_head(tmp_path)


def test_a_packed_target_head_is_run_as_it_is_not_copied(monkeypatch):
    """A GGUF target's head kept packed (engine.model.packed_linear): an EAGLE-1/2 head computes its logits through
    that module, as the target does, and never asks for the 16-bit matrix (a copy of the whole head)."""
    from moedesk.engine.model.packed_linear import PackedLinear
    from moedesk.kernels.quant_formats import dequantize, quantize

    head = random_head(EAGLE1)
    matrix = head.target_lm_head.clone()
    rows = quantize(matrix, "q8_0")
    packed = PackedLinear(rows, "q8_0", EAGLE1.hidden_size, dtype=torch.float32)
    monkeypatch.setattr(PackedLinear, "weight", property(lambda self: pytest.fail("the head was dequantised whole")))
    head.share_target_head(packed)
    assert head.target_lm_head is None and not any(b is rows for b in head.buffers())
    hidden = torch.randn(2, 3, EAGLE1.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(head.logits(hidden), packed(hidden), rtol=1e-5, atol=1e-5)  # the target's arithmetic
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # which without the CPU kernel is the dequantised matrix's
    expected = hidden @ dequantize(rows, "q8_0", EAGLE1.hidden_size).T
    torch.testing.assert_close(head.logits(hidden), expected, rtol=1e-5, atol=1e-5)
    plain = torch.nn.Linear(EAGLE1.hidden_size, VOCAB, bias=False)
    head.share_target_head(plain)  # a 16-bit head: its weight shared as the matrix, the packed one dropped
    assert head.target_lm_head.data_ptr() == plain.weight.data_ptr()
    torch.testing.assert_close(head.logits(hidden), hidden @ plain.weight.detach().T)
