"""Config fields that loaded silently and then misbehaved (issue 46, item 17)."""
import json

import pytest

from moedesk.engine.errors import CheckpointError, UnsupportedModelError
from moedesk.engine.model.architectures import parse_config


@pytest.fixture
def config(tiny_checkpoint):
    return json.loads((tiny_checkpoint("llama") / "config.json").read_text())


def test_an_eos_id_outside_the_vocabulary_is_refused(config):
    vocab = config["vocab_size"]
    parse_config({**config, "eos_token_id": [vocab - 1]})
    with pytest.raises(CheckpointError, match=f"eos_token_id must be from 0 to {vocab - 1}, got {vocab}"):
        parse_config({**config, "eos_token_id": [1, vocab]})


def test_rope_parameters_and_rope_scaling_that_disagree_are_refused(config):
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(UnsupportedModelError, match="rope_parameters says rope_type 'default' but rope_scaling says "
                                                     "'yarn'"):
        parse_config({**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                      "rope_scaling": yarn})
    same = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert parse_config({**config, "rope_parameters": same, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope.kind \
        == "linear"
