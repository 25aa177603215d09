"""Settings: the dataclass, its JSON file, and the screen built from its fields."""
from __future__ import annotations

import json

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.settings import FIELDS, FIELDS_BY_NAME, Settings, load_settings, save_settings, settings_path
from tests.tui.helpers import chat_ready, open_settings, wait_for


def test_fields_describe_themselves():
    names = [f.name for f in FIELDS]
    assert names[:1] == ["system_prompt"]
    assert {"temperature", "top_p", "max_new_tokens", "gpu_budget_gib"} <= set(names)
    assert FIELDS_BY_NAME["gpu_budget_gib"].optional and FIELDS_BY_NAME["gpu_budget_gib"].kind == "float"
    assert FIELDS_BY_NAME["max_new_tokens"].kind == "int" and not FIELDS_BY_NAME["max_new_tokens"].optional
    assert FIELDS_BY_NAME["system_prompt"].kind == "text"
    dtype = FIELDS_BY_NAME["dtype"]
    assert (dtype.kind, dtype.default, dtype.choices) == ("choice", "auto", ("auto", "bfloat16", "float16", "float32"))
    assert names.index("dtype") == names.index("gpu_budget_gib") + 1  # the load-time settings sit together
    experts = FIELDS_BY_NAME["expert_dtype"]
    assert (experts.kind, experts.default, experts.choices) == ("choice", "auto", ("auto", "bf16", "int8", "int4"))
    assert names.index("expert_dtype") == names.index("dtype") + 1
    assert all(f.label and f.help for f in FIELDS)
    assert Settings().problems() == {}


def test_parse_and_validate():
    t = FIELDS_BY_NAME["temperature"]
    assert t.parse(" 0.25 ") == 0.25
    for bad, message in (("abc", "number"), ("-1", "≥ 0"), ("nan", "number")):
        with pytest.raises(ValueError, match=message):
            t.parse(bad)
    assert t.parse("") is None  # blank: the model's own default
    with pytest.raises(ValueError, match="required"):
        FIELDS_BY_NAME["max_new_tokens"].parse("")
    with pytest.raises(ValueError, match="> 0"):
        FIELDS_BY_NAME["top_p"].parse("0")
    with pytest.raises(ValueError, match="whole number"):
        FIELDS_BY_NAME["max_new_tokens"].parse("1.5")
    assert FIELDS_BY_NAME["gpu_budget_gib"].parse("") is None
    assert FIELDS_BY_NAME["gpu_budget_gib"].parse("12") == 12.0
    assert FIELDS_BY_NAME["seed"].parse("7") == 7
    assert Settings(temperature=9.0).problems() == {"temperature": "must be ≥ 0 and ≤ 2"}


def test_save_load_round_trip_keeps_unknown_keys_and_leaves_no_temp_files(tui_dirs):
    path = settings_path()
    assert path.parent == tui_dirs["config"]
    assert load_settings() == Settings()  # no file yet: defaults
    path.write_text(json.dumps({"from_a_newer_moedesk": [1, 2]}))
    chosen = Settings(temperature=0.0, top_p=0.5, max_new_tokens=64, system_prompt="Be terse.", gpu_budget_gib=6.5)
    save_settings(chosen)
    assert load_settings() == chosen
    data = json.loads(path.read_text())
    assert data["from_a_newer_moedesk"] == [1, 2] and data["gpu_budget_gib"] == 6.5
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.json"]


def test_bad_file_or_values_fall_back_to_defaults_with_a_note(tui_dirs):
    path = settings_path()
    path.write_text("{not json")
    problems = []
    assert load_settings(problems=problems) == Settings()
    assert len(problems) == 1 and "unreadable" in problems[0]
    path.write_text(json.dumps({"temperature": "hot", "top_p": 2, "max_new_tokens": 100, "top_k": True,
                                "dtype": "int8"}))
    problems = []
    loaded = load_settings(problems=problems)
    assert loaded.max_new_tokens == 100 and loaded.temperature == Settings().temperature
    assert loaded.top_p == Settings().top_p and loaded.top_k is None and loaded.dtype == "auto"
    assert len(problems) == 4 and all("using" in p for p in problems)


def test_sampling_params():
    s = Settings(temperature=0.0, top_p=0.9, top_k=5, max_new_tokens=12)
    p = s.sampling_params(seed=42)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed) == (0.0, 0.9, 5, 12, 42)
    assert Settings(seed=3).sampling_params(seed=42).seed == 3


@pytest.mark.anyio
async def test_settings_screen_validates_saves_and_cancels(engine, tui_dirs, monkeypatch):
    from moedesk.engine.runtime import Engine

    app = MoedeskApp(engine, settings=Settings())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await open_settings(pilot)
        screen = app.screen
        # one row per field
        assert len(screen.query(".setting-row")) == len(FIELDS)
        assert "auto" in str(screen.query_one("#setting-dtype #label").render())

        screen.query_one("#setting-temperature").value = "9"
        await pilot.pause()
        assert "≤ 2" in str(screen.query_one("#error-temperature").render())
        assert screen.query_one("#row-temperature").has_class("-invalid")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen and not settings_path().exists()  # refused to save

        screen.query_one("#setting-temperature").value = "0.3"
        screen.query_one("#setting-max_new_tokens").value = "77"
        screen.query_one("#setting-gpu_budget_gib").value = ""
        screen.query_one("#setting-system_prompt").text = "You are terse."
        screen.query_one("#setting-dtype").focus()
        await pilot.press("enter", "down", "down", "enter")  # the list opens on auto: bfloat16, float16
        await pilot.pause()
        assert screen.query_one("#setting-dtype").value == "float16"
        assert not screen.query_one("#row-temperature").has_class("-invalid")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat again")
        assert app.settings.temperature == 0.3 and app.settings.max_new_tokens == 77
        assert app.settings.system_prompt == "You are terse." and app.settings.gpu_budget_gib is None
        assert app.settings.dtype == "float16"
        assert load_settings() == app.settings and json.loads(settings_path().read_text())["dtype"] == "float16"
        # The next model loaded gets it, though this app started on an engine loaded in float32.
        asked = []
        monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model, **kw: asked.append(kw["dtype"])))
        app.engine_factory("demo", None)
        assert asked == ["float16"]

        # Esc leaves without saving (over a change, at the second Esc: the first one warns).
        await open_settings(pilot)
        assert "float16" in str(app.screen.query_one("#setting-dtype #label").render())
        app.screen.query_one("#setting-max_new_tokens").value = "5"
        await pilot.pause()
        await pilot.press("escape", "escape")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat again")
        assert app.settings.max_new_tokens == 77 and load_settings().max_new_tokens == 77


def test_load_settings_reach_the_engine_at_each_load_and_flags_win(monkeypatch):
    from moedesk.app.tui import MoedeskApp
    from moedesk.app.tui.settings import Settings
    from moedesk.engine.runtime import Engine

    asked = []
    monkeypatch.setattr(Engine, "load",
                        classmethod(lambda cls, model, **kw: asked.append((kw["gpu_budget"], kw["dtype"]))))
    app = MoedeskApp(model="demo", device="cpu", settings=Settings(gpu_budget_gib=1.5, dtype="float16"))
    app.engine_factory("demo", None)
    app.settings = Settings(gpu_budget_gib=None)  # changed on the settings screen: the next load decides itself
    app.engine_factory("demo", None)
    MoedeskApp(model="demo", device="cpu", settings=Settings(gpu_budget_gib=1.5, dtype="float16"), gpu_budget=0.25,
               dtype="float32").engine_factory("demo", None)
    assert asked == [(1.5, "float16"), (None, None), (0.25, "float32")]
    experts = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model, **kw: experts.append(kw["expert_dtype"])))
    MoedeskApp(model="demo", device="cpu", settings=Settings(expert_dtype="int4")).engine_factory("demo", None)
    MoedeskApp(model="demo", device="cpu", settings=Settings(expert_dtype="int4"),
               expert_dtype="bf16").engine_factory("demo", None)  # --expert-dtype wins for this run
    assert experts == ["int4", "bf16"]
    counting = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model, **kw: counting.append(kw["count_experts"])))
    MoedeskApp(model="demo", device="cpu", settings=Settings()).engine_factory("demo", None)
    MoedeskApp(model="demo", device="cpu", settings=Settings(expert_counts=True)).engine_factory("demo", None)
    assert counting == [False, True]  # llama.cpp runs uncounted by default; on, the heat map gets its counts


def test_context_and_reprofile_flags_reach_every_load(monkeypatch):
    import moedesk.app.tui as tui_package
    from moedesk.app.cli import main
    from moedesk.app.tui import MoedeskApp
    from moedesk.app.tui.settings import Settings
    from moedesk.engine.runtime import Engine

    asked = []
    monkeypatch.setattr(Engine, "load", classmethod(
        lambda cls, model, **kw: asked.append((model, kw["context_length"], kw.get("reprofile", False)))))
    MoedeskApp(model="demo", device="cpu", settings=Settings()).engine_factory("demo", None)
    flagged = MoedeskApp(model="demo", device="cpu", settings=Settings(), context_length=512, reprofile=True)
    flagged.engine_factory("demo", None)
    flagged.engine_factory("other", None)  # a model loaded later from the models screen
    assert asked == [("demo", None, False), ("demo", 512, True), ("other", 512, True)]

    runs = []
    monkeypatch.setattr(tui_package, "run_app", lambda *args: runs.append(args) or 0)
    assert main(["--model", "m", "--context", "512", "--reprofile"]) == 0
    assert main(["chat", "--expert-dtype", "int4"]) == 0
    assert runs == [("m", "auto", None, None, 512, True, None), ("demo", "auto", None, None, None, False, "int4")]
    options = []
    monkeypatch.setattr(tui_package, "run_app", lambda *args, **kw: options.append(kw) or 0)
    assert main(["--engine", "llama.cpp"]) == 0 and options == [{"engine": "llama.cpp"}]
    engines = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model, **kw: engines.append(kw.get("engine"))))
    MoedeskApp(model="demo", device="cpu", settings=Settings(engine="native")).engine_factory("demo", None)
    MoedeskApp(model="demo", device="cpu", settings=Settings(engine="native"), engine_kind="llama.cpp"
               ).engine_factory("demo", None)
    assert engines == ["native", "llama.cpp"]  # the setting, and the --engine flag over it


def test_blank_sampling_boxes_show_the_models_own_defaults():
    from moedesk.app.tui.screens.settings import blank_means

    temperature, top_k = FIELDS_BY_NAME["temperature"], FIELDS_BY_NAME["top_k"]
    assert blank_means(temperature, {"temperature": 0.0}) == "blank: 0, the model's default"
    assert blank_means(temperature, {}) == "blank: 0.7"
    assert blank_means(top_k, {"temperature": 0.0}) == "blank: 0"
    assert blank_means(FIELDS_BY_NAME["gpu_budget_gib"], {}) == "blank: automatic"
