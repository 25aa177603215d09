"""`moedesk export-draft` (engine.speculative.eagle_export): an EAGLE-3 head folder as vLLM and SGLang load it.

The folder written is read back with safetensors and json and held against tables taken from those engines' own
loaders (the files and lines cited, in the releases named), not against our writer: every tensor name, once put
through the loader's own renaming, must name a parameter the loader makes, with the shape and dtype it makes it;
every parameter but the shared embedding must be loaded; the config keys must be those the loaders read, the
feature layers in each engine's numbering. The folder then loads back with our own loader and drafts as before.
"""
import json

import pytest
import torch
from safetensors import safe_open

from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.engine.speculative.eagle import EagleConfig, eagle3_feature_layers, load_eagle_head, save_eagle_head
from moedesk.engine.speculative.eagle_export import aux_layer_ids, export_eagle3
from tests.speculative.test_eagle_head import EAGLE1, EAGLE3, VOCAB, random_head

TARGET_LAYERS = 48
# a head as `moedesk train-draft --head eagle3` makes one: as wide as the model, no embedding of its own
EQUAL_WIDTH = EagleConfig(version=3, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                          rms_norm_eps=1e-5, vocab_size=VOCAB, draft_vocab_size=20, target_hidden_size=64,
                          fc_bias=False)
WHOLE_VOCAB = EagleConfig(**{**EQUAL_WIDTH.__dict__, "draft_vocab_size": VOCAB})

# --- the loaders' tables ----------------------------------------------------------------------------------------
# vLLM 0.33.0, vllm/model_executor/models/llama_eagle3.py:
#   L426-429  t2d is skipped; d2t is renamed draft_id_to_target_id
#   L443-444  every other name but lm_head.* gets the prefix "model."
#   L290-299  "midlayer." is read as "layers.0."; q/k/v and gate/up stack into qkv_proj and gate_up_proj
#   L339-345  draft_id_to_target_id [draft_vocab] long exists only when draft_vocab_size != the target's vocab
#             (so a d2t there would name no parameter)
#   L445,460  embed_tokens is optional (the target's is shared when absent)
#   L218-221,242-250  fc: [hidden, 3 * target_hidden_size], no bias
#   L70-82    qkv_proj over 2 * hidden inputs, bias only with "attention_bias"
# vllm/model_executor/models/llama.py L268-271: "bias" (or "attention_bias") also gives o_proj a bias.
# vllm/model_executor/models/llama.py L429-441: aux id j is the residual stream after layer j - 1 (entering j).
# vllm/v1/worker/gpu_model_runner.py L5207: the ids come from the top-level "eagle_aux_hidden_state_layer_ids"
#   (L5218-5219: else from "eagle_config").
# SGLang 0.5.23, python/sglang/srt/models/llama_eagle3.py:
#   L339      "midlayer" is read as "layers.0"; L350-355 d2t becomes hot token ids (d2t + arange), t2d is skipped
#   L362,372-373  a name not a parameter is prefixed "model." and otherwise dropped without a word
#   L166      fc bias from config "bias"; L303-304 tie_word_embeddings makes the embedding the LM head;
#   L306-308  draft_vocab_size missing: the LM head is the target's; L72 qkv_proj has no bias
# python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py L188-193: the ids come from
#   "eagle_config"["eagle_aux_hidden_state_layer_ids"]; python/sglang/srt/models/llama.py L941: the layer captured
#   is id + 1 (id names the layer whose output is taken).
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}


def parameters(cfg: EagleConfig, engine: str, own_map: bool) -> dict[str, tuple]:
    """The parameters `engine`'s EAGLE-3 model makes for a one-layer head: name -> the shape each checkpoint tensor
    loaded into it has (the stacked ones: the shapes of their parts)."""
    d, qkv_in = cfg.hidden_size, 2 * cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = "model.layers.0."
    p = {"model.embed_tokens.weight": [(cfg.vocab_size, d)], "model.fc.weight": [(d, 3 * cfg.target_hidden_size)],
         layer + "self_attn.qkv_proj.weight": [(q, qkv_in), (kv, qkv_in), (kv, qkv_in)],
         layer + "self_attn.o_proj.weight": [(d, q)],
         layer + "mlp.gate_up_proj.weight": [(cfg.intermediate_size, d)] * 2,
         layer + "mlp.down_proj.weight": [(d, cfg.intermediate_size)],
         layer + "input_layernorm.weight": [(d,)], layer + "hidden_norm.weight": [(d,)],
         layer + "post_attention_layernorm.weight": [(d,)], "model.norm.weight": [(d,)],
         "lm_head.weight": [(cfg.draft_vocab_size, d)]}
    if engine == "vllm" and own_map:
        p["draft_id_to_target_id"] = [(cfg.draft_vocab_size,)]
    return p


def loader_name(name: str, engine: str) -> str | None:
    """A checkpoint tensor's name as `engine`'s EAGLE-3 load_weights renames it (None: skipped on purpose)."""
    if name == "t2d" or engine == "sglang" and name == "d2t":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    for part, stacked in STACKED.items():
        name = name.replace(part, stacked)
    return name if name.startswith("lm_head") else "model." + name


def read_back(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


def head_folder(tmp_path, cfg, seed=0, embedding=False, name="head"):
    head = random_head(cfg, seed)
    folder = save_eagle_head(head, tmp_path / name, with_embedding=embedding)
    return head, folder


# --- the folder against the tables --------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,embedding", [(EQUAL_WIDTH, False), (EAGLE3, True), (WHOLE_VOCAB, False)],
                         ids=["as-trained", "narrow-with-embedding", "whole-vocabulary"])
def test_every_tensor_is_one_the_loaders_make_with_their_shape_and_dtype(tmp_path, cfg, embedding):
    _, src = head_folder(tmp_path, cfg, embedding=embedding)
    tensors, hf = read_back(export_eagle3(src, tmp_path / "out", target_layers=TARGET_LAYERS))
    own_map = cfg.draft_vocab_size != cfg.vocab_size
    assert ("d2t" in tensors) == ("t2d" in tensors) == own_map
    if own_map:
        assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (cfg.draft_vocab_size,)
        assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (cfg.vocab_size,)
    for engine in ("vllm", "sglang"):
        made = parameters(cfg, engine, own_map)
        loaded: dict[str, list] = {}
        for name, t in tensors.items():
            target = loader_name(name, engine)
            if target is None:
                continue
            assert target in made, f"{engine}: {name} names no parameter ({target})"
            loaded.setdefault(target, []).append(tuple(t.shape))
            assert t.dtype == (torch.int64 if name == "d2t" else torch.float32), name
        # stacked parts arrive q, k, v and gate, up: sorted order is the same
        assert {k: sorted(v) for k, v in loaded.items()} == \
               {k: sorted(v) for k, v in made.items() if k in loaded}, engine
        unloaded = set(made) - set(loaded)
        assert unloaded == (set() if embedding else {"model.embed_tokens.weight"}), (engine, unloaded)


def test_config_holds_the_keys_those_loaders_read(tmp_path):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    _, hf = read_back(export_eagle3(src, tmp_path / "out", target_layers=TARGET_LAYERS))
    expected = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": VOCAB,
                "draft_vocab_size": 20, "target_hidden_size": 64, "bias": False, "tie_word_embeddings": False,
                "rope_theta": EQUAL_WIDTH.rope.theta,
                "eagle_aux_hidden_state_layer_ids": [2, 24, 45],
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 23, 44]}}
    assert {k: hf.get(k) for k in expected} == expected
    assert "attention_bias" not in hf and hf["moedesk"]["feature_layers"] == [2, 24, 45]


def test_config_reads_through_transformers_as_those_engines_read_it(tmp_path):
    # both build the draft's hf_config with transformers' AutoConfig, then getattr the keys above
    from transformers import AutoConfig

    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    c = AutoConfig.from_pretrained(str(export_eagle3(src, tmp_path / "out", target_layers=TARGET_LAYERS)))
    assert type(c).__name__ == "LlamaConfig" and c.architectures == ["LlamaForCausalLMEagle3"]
    assert (c.tie_word_embeddings, c.bias, c.attention_bias) == (False, False, False)
    assert (c.draft_vocab_size, c.target_hidden_size, c.head_dim, c.num_hidden_layers) == (20, 64, 16, 1)
    assert c.eagle_aux_hidden_state_layer_ids == [2, 24, 45]
    assert c.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 23, 44]


def test_each_engines_layer_ids_capture_the_layers_the_head_was_trained_on():
    # vLLM: id j is the stream entering layer j; SGLang: id j is the output of layer j, the stream entering j + 1
    captured = {"vllm": lambda j: j, "sglang": lambda j: j + 1}
    for layers in (16, 24, 48, 61):
        for engine, entering in captured.items():
            assert tuple(entering(j) for j in aux_layer_ids(layers, engine)) == eagle3_feature_layers(layers)
    # with no ids, both engines default to (2, L//2, L-3) in their own numbering: vLLM's default is ours
    assert aux_layer_ids(48, "vllm") == [2, 24, 45]


@pytest.mark.parametrize("engines,top,nested", [(("vllm",), True, False), (("sglang",), False, True)])
def test_one_engine_gets_only_its_key(tmp_path, engines, top, nested):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    _, hf = read_back(export_eagle3(src, tmp_path / "out", engines, target_layers=TARGET_LAYERS))
    assert ("eagle_aux_hidden_state_layer_ids" in hf) == top and ("eagle_config" in hf) == nested


# --- our own loader reads it back, drafting unchanged ------------------------------------------------------------

@pytest.mark.parametrize("cfg", [EQUAL_WIDTH, WHOLE_VOCAB], ids=["draft-vocabulary", "whole-vocabulary"])
def test_the_exported_head_drafts_as_the_original(tmp_path, cfg):
    head, src = head_folder(tmp_path, cfg, seed=3)
    if cfg is WHOLE_VOCAB:  # a permuted map: the export reorders the LM head so that the identity holds
        perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            head.d2t.copy_(perm - torch.arange(VOCAB))
            head.t2d.fill_(True)
        src = save_eagle_head(head, src, with_embedding=False)
    out = export_eagle3(src, tmp_path / "out", target_layers=TARGET_LAYERS)
    back = load_eagle_head(out, target_embed=head.embed).eval()
    g = torch.Generator().manual_seed(4)
    tokens, feats = torch.randint(0, VOCAB, (1, 5), generator=g), torch.randn(1, 5, cfg.feature_size, generator=g)
    with torch.no_grad():
        a = head(tokens, feats, torch.arange(5)[None], head.new_cache(1, 8))
        b = back(tokens, feats, torch.arange(5)[None], back.new_cache(1, 8))
        assert torch.equal(a, b)
        # the original's draft logits spread to target ids by hand (d2t), as rejection sampling takes them
        spread = torch.full((1, 5, VOCAB), float("-inf")).index_copy(
            -1, head.to_target_ids(torch.arange(cfg.draft_vocab_size)), head.logits(a))
        torch.testing.assert_close(back.target_vocab_logits(b), spread, rtol=1e-6, atol=1e-6)  # rows reordered
        # a chain of draft steps fed the head's own outputs
        nxt_a, nxt_b = a[:, -1:], b[:, -1:]
        ca, cb = head.new_cache(1, 8), back.new_cache(1, 8)
        for step in range(3):
            tok = head.to_target_ids(head.logits(nxt_a).argmax(-1))
            assert torch.equal(tok, back.to_target_ids(back.logits(nxt_b).argmax(-1)))
            pos = torch.tensor([[step]])
            nxt_a = head(tok, nxt_a, pos, ca, from_target=False)
            nxt_b = back(tok, nxt_b, pos, cb, from_target=False)


# --- refusals: one line, nothing lost -------------------------------------------------------------------------------

def one_line(fn) -> str:
    with pytest.raises(MoedeskError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_an_eagle1_head_is_refused_and_says_why(tmp_path):
    _, src = head_folder(tmp_path, EAGLE1, embedding=True)
    message = one_line(lambda: export_eagle3(src, tmp_path / "out", target_layers=TARGET_LAYERS))
    assert "EAGLE-1" in message and "LM head" in message and "--head eagle3" in message
    assert not (tmp_path / "out").exists()


def test_what_is_not_a_head_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in one_line(lambda: export_eagle3(tmp_path / "empty", tmp_path / "o", target_layers=8))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert "model.safetensors" in one_line(lambda: export_eagle3(model, tmp_path / "o", target_layers=8))
    (model / "config.json").write_text("{not json")
    assert "JSON" in one_line(lambda: export_eagle3(model, tmp_path / "o", target_layers=8))
    assert not (tmp_path / "o").exists()


def test_an_output_folder_holding_files_is_left_alone(tmp_path):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "not an empty folder" in one_line(lambda: export_eagle3(src, out, target_layers=TARGET_LAYERS))
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert "own folder" in one_line(lambda: export_eagle3(src, src, target_layers=TARGET_LAYERS))


def test_the_layer_count_comes_from_the_head_or_the_flag(tmp_path):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    assert "--target-layers" in one_line(lambda: export_eagle3(src, tmp_path / "a"))
    assert "positive" in one_line(lambda: export_eagle3(src, tmp_path / "a", target_layers=0))
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "moedesk": {"target_layers": 16}}))
    _, out = read_back(export_eagle3(src, tmp_path / "b"))
    assert out["eagle_aux_hidden_state_layer_ids"] == [2, 8, 13]


def test_a_model_too_shallow_for_increasing_feature_layers_is_refused(tmp_path):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    for layers in (3, 6):
        assert f"a model of {layers} layers" in one_line(lambda: export_eagle3(src, tmp_path / "o", target_layers=layers))
    assert export_eagle3(src, tmp_path / "o", target_layers=7).is_dir()  # (2, 3, 4)


def test_cli(tmp_path, capsys):
    _, src = head_folder(tmp_path, EQUAL_WIDTH)
    out = tmp_path / "out"
    code = main(["export-draft", str(src), "--out", str(out), "--for", "sglang", "--target-layers", "24"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert str(out) in err and json.loads((out / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 11, 20]
    _, eagle1 = head_folder(tmp_path, EAGLE1, name="e1")
    code = main(["export-draft", str(eagle1), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "EAGLE-1" in err and "\n" not in err
