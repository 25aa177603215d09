"""One module builds every front end's decoding options (engine.decoding): the rules, and the four front ends
offering the same speculative modes from it."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from moedesk.engine.decoding import SPECULATIVE_MODES, Decoding, decoding_options, speculative_draft
from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.beam import BeamOptions
from moedesk.engine.speculative.options import SpeculativeOptions


class FakeEngine:
    """What the options builder asks of an engine: its model's name, and loading a head folder."""

    def __init__(self, name="some-moe"):
        self.name = name
        self.loaded = []

    def load_draft(self, path):
        self.loaded.append(path)


def factory(batch, capacity):  # a drafter factory: never loaded, never checked against a folder
    raise AssertionError("not called while options are built")


def test_beam_search_takes_precedence_and_plain_is_none():
    engine = FakeEngine()
    beam = decoding_options(engine, Decoding(speculative="greedy", draft=factory, beams=3, length_penalty=0.5))
    assert beam == BeamOptions(3, 0.5)
    assert decoding_options(engine, Decoding()) is None
    assert decoding_options(engine, Decoding(speculative="off", draft="/some/head")) is None
    assert engine.loaded == []


@pytest.mark.parametrize("mode", ["greedy", "beam", "auto"])
def test_speculative_options_carry_the_choice(mode):
    engine = FakeEngine()
    options = decoding_options(engine, Decoding(mode, factory, draft_length=3, draft_width=2))
    assert options == SpeculativeOptions(mode, factory, 3, 2)
    assert engine.loaded == []


def test_a_head_folder_is_loaded_only_when_asked(tmp_path):
    engine = FakeEngine()
    decoding_options(engine, Decoding("greedy", str(tmp_path)))
    assert engine.loaded == []
    options = decoding_options(engine, Decoding("greedy", str(tmp_path)), load_draft=True)
    assert options.draft == str(tmp_path) and engine.loaded == [str(tmp_path)]


def test_no_head_for_a_model_without_one_is_one_line():
    with pytest.raises(MoedeskError, match="needs --draft PATH") as raised:
        decoding_options(FakeEngine(), Decoding("auto"))
    assert "\n" not in str(raised.value)


def test_the_demo_drafts_with_its_shipped_head():
    engine = FakeEngine("demo")
    head = speculative_draft(engine, None)
    assert (head / "config.json").is_file() and engine.loaded == [head]


def test_an_unknown_mode_or_shape_is_refused_in_one_line():
    with pytest.raises(ValueError, match="speculative mode"):
        decoding_options(FakeEngine(), Decoding("sideways", factory))
    with pytest.raises(ValueError, match="draft length"):
        decoding_options(FakeEngine(), Decoding("greedy", factory, draft_length=0))


def _choices(parser: argparse.ArgumentParser, flag: str):
    return next(a.choices for a in parser._actions if flag in a.option_strings)


def test_every_front_end_offers_the_engines_modes():
    from moedesk.app.batch import add_batch_arguments
    from moedesk.app.cli import build_parser
    from moedesk.app.tui.settings import FIELDS_BY_NAME

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("chat", "serve"):
        assert tuple(_choices(sub.choices[command], "--speculative")) == SPECULATIVE_MODES
    batch = argparse.ArgumentParser()
    add_batch_arguments(batch)
    assert tuple(_choices(batch, "--speculative")) == SPECULATIVE_MODES
    assert tuple(FIELDS_BY_NAME["speculative"].choices) == SPECULATIVE_MODES


def test_the_server_refuses_a_mode_the_engine_does_not_offer():
    from moedesk.app.server import ApiError, Server

    server = Server.__new__(Server)  # _decoding reads only the server's speculation and (its pool's) engine
    server.pool = SimpleNamespace(current=SimpleNamespace(engine=SimpleNamespace(name="some-moe")))
    server.speculation = None
    with pytest.raises(ApiError, match="must be one of off, greedy, beam, auto"):
        server._decoding({"speculative": "sideways"}, None, False)
