"""`moedesk train-draft --head eagle3` (training.train) on a tiny random Mixtral.

The data holds the target's three layer inputs (what decoding asks it for) and its last hidden state; training
lowers the token loss on a fixed batch; the folder written loads as an EAGLE-3 head (identity draft vocabulary),
and speculative decoding with it is plain greedy token for token (chains and trees); eagle1 data is not reused. (A
run interrupted and resumed ends bit for bit where an uninterrupted one does: test_train_draft.py, for both kinds.)
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.training import train as T
from moedesk.engine.speculative.eagle import _names, eagle3_feature_layers, load_eagle_head
from moedesk.engine.speculative.eagle_export import export_eagle3
from tests.speculative.train_helpers import assert_speculation_is_plain_greedy, figures_before_and_after_training

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def settings(**kw):
    return T.TrainSettings(**{**dict(steps=8, batch_size=3, max_new_tokens=12, lr=3e-3, warmup=2, head="eagle3"),
                              **kw})


@pytest.fixture(scope="module")
def data(engine, prompts_file):
    return T.generate_data(engine, T.load_prompts(prompts_file), max_new_tokens=12, head="eagle3")


def test_data_holds_the_three_layer_inputs_and_the_last_hidden_state(engine, data):
    d = engine.config.hidden_size
    assert data.features.shape == (len(data.tokens), 3 * d) and data.final.shape == (len(data.tokens), d)
    assert data.features.dtype == data.final.dtype == torch.bfloat16
    # the first sequence's features are the target's own hidden states at those keys
    tokens, feats = data.sequence(0)
    keys = (*eagle3_feature_layers(engine.config.num_layers), "final")
    from moedesk.engine.model.cache.kv import KVCache

    cache = KVCache(engine.config, 1, len(tokens), engine.dtype, engine.device)
    _, hidden = engine.model(tokens[None], torch.arange(len(tokens))[None], cache, engine.executor, features=keys)
    want = torch.cat([hidden[k][0] for k in keys], dim=-1).to(torch.bfloat16)
    got = torch.cat([feats, data.final[:len(tokens)]], dim=-1)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_data_key_tells_eagle3_from_eagle1(engine):
    prompts = ["a"]
    assert T.data_key(engine, prompts, 12) == T.data_key(engine, prompts, 12, head="eagle1")
    assert T.data_key(engine, prompts, 12, head="eagle3") != T.data_key(engine, prompts, 12)


def test_init_is_deterministic_and_passes_the_deepest_feature_through(engine):
    cfg = T.head_config(engine, "eagle3")
    a, b = (T.init_head(engine, cfg, "fit", 5) for _ in range(2))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    d = cfg.hidden_size
    assert torch.equal(a.fc.weight[:, 2 * d:], torch.eye(d)) and not a.fc.weight[:, :2 * d].any()
    assert torch.equal(a.lm_head.weight, engine.model.lm_head.weight.float()) and not a.lm_head.weight.requires_grad
    assert torch.equal(a.norm.weight, engine.model.norm.weight.float())
    assert a.t2d.all() and not a.d2t.any()


def test_training_lowers_the_token_loss(engine, data):
    s = settings(steps=30)
    head = T.init_head(engine, T.head_config(engine, "eagle3"), s.init, s.seed)
    before, after = figures_before_and_after_training(engine, head, data, s)
    assert "feature" not in before  # EAGLE-3 has no feature loss
    assert after["loss"] < before["loss"]
    assert sum(after["agree"]) > sum(before["agree"])
    assert torch.equal(head.lm_head.weight, engine.model.lm_head.weight.float())  # frozen


def test_head_loads_as_eagle3_and_speculation_with_it_is_lossless(engine, prompts_file, tmp_path):
    summary = T.train_draft(engine, tmp_path, prompts_file, settings(steps=12))
    assert summary["steps"] == 12 and summary["settings"]["head"] == "eagle3"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    head = load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach())
    assert head.cfg.version == 3 and head.cfg.draft_vocab_size == engine.config.vocab_size
    assert set(tensors) == set(_names(head.cfg))
    assert {"midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d"} <= set(tensors) and "fc.bias" not in tensors
    assert head.fc.weight.shape == (engine.config.hidden_size, 3 * engine.config.hidden_size)
    assert head.t2d.all() and not head.d2t.any()
    assert_speculation_is_plain_greedy(engine, tmp_path)
    # the head records the model's layer count, which `moedesk export-draft` reads: this model's 3 layers give
    # features (2, 1, 0), out of the layer order vLLM and SGLang concatenate in, refused in one line
    out = tmp_path.parent / f"{tmp_path.name}-export"
    assert json.loads((tmp_path / "config.json").read_text())["moedesk"]["target_layers"] == engine.config.num_layers
    with pytest.raises(MoedeskError, match=f"a model of {engine.config.num_layers} layers") as err:
        export_eagle3(tmp_path, out)
    assert "\n" not in str(err.value) and not out.exists()
    # told another count, the folder written still loads here and drafts as the head did
    export_eagle3(tmp_path, out, target_layers=48)
    assert_speculation_is_plain_greedy(engine, out)


def test_cli_head_flag(engine, prompts_file, tmp_path, capsys):
    code = main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path), "--prompts", str(prompts_file),
                 "--head", "eagle3", "--steps", "1", "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach()).cfg.version == 3
    # resuming with the other kind is refused in one line
    code = main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path), "--prompts", str(prompts_file),
                 "--head", "eagle1", "--resume", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "head='eagle3'" in err and "\n" not in err, err
