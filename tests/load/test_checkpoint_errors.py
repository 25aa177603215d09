"""Bad checkpoints give one clear line naming the file and the problem, never a traceback."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from moedesk.engine.errors import CheckpointError, MoedeskError, UnsupportedModelError
from moedesk.engine.runtime import Engine


@pytest.fixture
def model_copy(tiny_checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("mixtral"), folder)
    return folder


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


def test_sharded_checkpoint_loads(model_copy):
    shard(model_copy, 3)
    assert Engine.load(str(model_copy), device="cpu").config.num_experts == 4


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, model_type="mamba")
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, str(model_copy), "unsupported architecture 'mamba'")


def test_unknown_config_field_that_changes_the_computation(model_copy):
    edit_config(model_copy, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "attn_logit_softcapping")


def test_unsupported_activation_and_rope(model_copy):
    edit_config(model_copy, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "hidden_act")
    edit_config(model_copy, hidden_act="silu", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(UnsupportedModelError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "yarn")


def test_missing_shard(model_copy):
    shard(model_copy, 2)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "model-00002-of-00002.safetensors", "missing")


def test_truncated_shard(model_copy):
    shard(model_copy, 2)
    path = model_copy / "model-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, str(path), "truncated or corrupt")


def test_missing_tensor(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "missing tensors", "layers.1.moe.experts.2.up.weight")


def test_shape_disagrees_with_config(model_copy):
    edit_config(model_copy, hidden_size=80)
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "has shape")


def test_no_weights_and_no_such_model(tmp_path, model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Engine.load(str(model_copy), device="cpu")
    one_line_error(e, "no *.safetensors")
    with pytest.raises(MoedeskError) as e:
        Engine.load(str(tmp_path / "nowhere"), device="cpu")
    one_line_error(e, "no such model")
    with pytest.raises(MoedeskError) as e:
        Engine.load(str(tmp_path / "gone.gguf"), device="cpu")
    one_line_error(e, "gone.gguf", "no such file")
