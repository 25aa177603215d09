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
