"""Bad checkpoints give one clear line naming the file and the problem, never a traceback."""
import json

import pytest
from safetensors.torch import load_file, save_file

from moedesk.engine.errors import CheckpointError, MoedeskError, UnsupportedModelError
from moedesk.engine.runtime import Engine


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def shard(folder, parts=2):
    """Split model.safetensors into `parts` shards with an index, as large checkpoints come."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for p in range(parts):
        file = f"model-{p + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[p::parts]}
        save_file(chunk, folder / file)
        weight_map.update({n: file for n in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads(mixtral):
    shard(mixtral, 3)
    assert Engine.load(str(mixtral), device="cpu").config.num_experts == 4


def test_unsupported_architecture(mixtral):
    edit_config(mixtral, model_type="mamba")
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, str(mixtral), "unsupported architecture 'mamba'")


def test_unknown_config_field_that_changes_the_computation(mixtral):
    edit_config(mixtral, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "attn_logit_softcapping")


def test_unsupported_activation_and_rope(mixtral):
    edit_config(mixtral, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "hidden_act")
    edit_config(mixtral, hidden_act="silu", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "yarn")


def test_missing_shard(mixtral):
    shard(mixtral, 2)
    (mixtral / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "model-00002-of-00002.safetensors", "missing")


def test_truncated_shard(mixtral):
    shard(mixtral, 2)
    path = mixtral / "model-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, str(path), "truncated or corrupt")


def test_missing_tensor(mixtral):
    tensors = load_file(mixtral / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, mixtral / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "missing tensors", "layers.1.moe.experts.2.up.weight")


def test_shape_disagrees_with_config(mixtral):
    edit_config(mixtral, hidden_size=80)
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "has shape")


def test_no_weights_and_no_such_model(tmp_path, mixtral):
    (mixtral / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(mixtral), device="cpu")
    one_line_error(e, "no *.safetensors")
    with pytest.raises(MoedeskError) as e:
        Engine.load(str(tmp_path / "nowhere"), device="cpu")
    one_line_error(e, "no such model")
    with pytest.raises(MoedeskError) as e:
        Engine.load(str(tmp_path / "gone.gguf"), device="cpu")
    one_line_error(e, "gone.gguf", "no such file")
