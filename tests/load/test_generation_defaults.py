"""A model's own sampling defaults: from generation_config.json as transformers writes it, from GGUF metadata as
the gguf package writes it, from the demo's recipe; applied where the user's settings are blank."""
import gguf
import numpy as np
import pytest

from moedesk.app.tui.settings import Settings
from moedesk.engine.load.checkpoint import SafetensorsCheckpoint
from moedesk.engine.load.generation_defaults import from_generation_config
from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
from tests.tiny_models import build


def test_generation_config_as_transformers_writes_it(tmp_path):
    from transformers import GenerationConfig

    folder = build("llama", tmp_path / "m")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20).save_pretrained(folder)
    assert SafetensorsCheckpoint(folder).generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    # do_sample false: transformers decodes greedily whatever temperature says.
    GenerationConfig(do_sample=False, bos_token_id=1).save_pretrained(folder)
    assert SafetensorsCheckpoint(folder).generation_defaults == {"temperature": 0.0}
    (folder / "generation_config.json").unlink()
    assert SafetensorsCheckpoint(folder).generation_defaults == {}


def test_values_out_of_range_are_left_out():
    assert from_generation_config({"temperature": -1, "top_p": 0, "top_k": 2.5}) == {}
    assert from_generation_config({"temperature": float("nan"), "top_p": True, "top_k": -1}) == {"top_k": 0}
    assert from_generation_config(["not", "a", "dict"]) == {}


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(32)
    w.add_head_count(2); w.add_layer_norm_rms_eps(1e-5)
    w.add_sampling_temp(0.25); w.add_sampling_top_p(0.5); w.add_sampling_top_k(-1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert GGUFCheckpoint(path).generation_defaults == {"temperature": 0.25, "top_p": 0.5, "top_k": 0}


def test_the_users_value_wins_then_the_models_then_the_fallback():
    model = {"temperature": 0.0, "top_k": 20}
    params = Settings().sampling_params(seed=1, model_defaults=model)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 20)
    params = Settings(temperature=0.5, top_k=0).sampling_params(seed=1, model_defaults=model)
    assert (params.temperature, params.top_k) == (0.5, 0)
    assert Settings().sampling_params(seed=1).temperature == 0.7


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k"])
def test_blank_is_the_default_setting(field):
    assert getattr(Settings(), field) is None


def test_batch_takes_the_models_defaults_only_where_nothing_was_set():
    import argparse

    from moedesk.app.batch import add_batch_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["in.jsonl", "-o", "out.jsonl", "--top-p", "0.8"])
    settings = settings_from_args(args, Settings(top_k=7)).with_model_defaults(
        {"temperature": 0.0, "top_p": 0.5, "top_k": 20})
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.0, 0.8, 7)
    assert "temperature=0.0+" in settings.describe() and "the model's own default" in settings.describe()
