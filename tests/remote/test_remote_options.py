"""--engine remote, --url and the key reach Engine.load from every command and from the app's settings."""
from moedesk.app.cli import build_parser, load_engine
from moedesk.app.tui.settings import Settings


def test_settings_give_the_remote_server_only_for_the_remote_engine():
    remote = Settings(engine="remote", remote_url=" http://gpu-box:8000 ", remote_api_key="k").load_options()
    assert (remote["engine"], remote["url"], remote["api_key"]) == ("remote", "http://gpu-box:8000", "k")
    local = Settings(engine="auto", remote_url="http://gpu-box:8000").load_options()
    assert "url" not in local and "api_key" not in local


def test_flags_reach_engine_load(monkeypatch):
    seen = {}
    monkeypatch.setattr("moedesk.engine.runtime.Engine.load", staticmethod(lambda model, **kw: seen.update(kw)))
    parser = build_parser()
    for argv in (["batch", "in.jsonl", "-o", "out.jsonl", "--engine", "remote", "--url", "h:1", "--api-key", "k"],
                 ["profile", "--engine", "remote", "--url", "h:1", "--api-key", "k"],
                 # serve's own --api-key is what its clients send: the remote server's key has a name of its own
                 ["serve", "--api-key", "mine", "--engine", "remote", "--url", "h:1", "--remote-api-key", "k"]):
        seen.clear()
        load_engine(parser.parse_args(argv))
        assert (seen["engine"], seen["url"], seen["api_key"]) == ("remote", "h:1", "k"), argv
        assert seen["count_experts"] is False, argv  # no heat map there: llama.cpp's counting is not paid for


def test_a_folder_of_tokenizer_files_is_enough(tiny_checkpoint, tmp_path):
    """The server holds the weights: a folder with config and tokenizer files describes a model moedesk does not
    run itself (DeepSeek-V3 here), with no safetensors beside them."""
    import json
    import shutil

    from moedesk.engine.load.checkpoint import ModelFiles
    from moedesk.engine.model.architectures import parse_config
    from moedesk.engine.remote.engine import described_config

    source = tiny_checkpoint("qwen3_moe")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
              "num_attention_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
              "first_k_dense_replace": 3, "eos_token_id": 1, "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    files = ModelFiles(tmp_path)
    assert files.tokenizer is not None and "chat_template" in files.tokenizer_config
    cfg = described_config(files.config)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.num_layers) == ("deepseek_v3", 256, 8, 61)
    assert [cfg.is_moe_layer(i) for i in (2, 3)] == [False, True] and cfg.eos_token_ids == (1,)
    assert parse_config(json.loads((source / "config.json").read_text()), source).arch == "qwen3_moe"


def test_the_heat_map_says_a_remote_model_has_no_map_to_show():
    from moedesk.app.tui.widgets.heatmap import ExpertHeatMap

    heatmap = ExpertHeatMap()
    heatmap.device = "remote"
    assert "not available" in heatmap._lines(40)[0].plain
    heatmap.device = "cuda"
    assert "dense model" in heatmap._lines(40)[0].plain  # a local model without experts, as before
