"""JSON nested 10^5 deep in any file moedesk reads: one line and exit 2 from a command, the file set aside by the
app; never a RecursionError traceback (issue 46, item 13)."""
import pytest

from moedesk.app.tui.settings import load_settings
from moedesk.app.tui.storage import ConversationStore
from moedesk.engine.errors import CheckpointError
from moedesk.engine.speculative.eagle import load_eagle_head
from tests.load.test_bad_input import batch_error

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 100_000 + "1" + "}" * 100_000


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "model.safetensors.index.json"])
def test_a_model_file(mixtral, tmp_path, capsys, name):  # noqa: F811
    (mixtral / name).write_text(DEEP_OBJECT)
    line = batch_error(mixtral, tmp_path, capsys)
    assert name in line and "nested too deeply" in line


def test_a_draft_heads_config(tmp_path):
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_eagle_head(tmp_path)


def test_settings_conversations_and_the_unsent_message_are_set_aside(tmp_path, monkeypatch):
    from moedesk.app.tui.settings import settings_path

    monkeypatch.setenv("MOEDESK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOEDESK_CONFIG_DIR", str(tmp_path / "config"))
    settings_path().parent.mkdir(parents=True)
    settings_path().write_text(DEEP)
    problems = []
    load_settings(problems=problems)
    assert len(problems) == 1 and "nested too deeply" in problems[0]
    store = ConversationStore()
    store.folder.mkdir(parents=True, exist_ok=True)
    (store.folder / "c1.json").write_text(DEEP_OBJECT)
    [problem] = store.set_aside_unreadable()
    assert "c1" in problem and not (store.folder / "c1.json").exists()
    store.draft_path.write_text(DEEP)
    text, problem = store.load_draft()
    assert text == "" and "kept as" in problem and not store.draft_path.exists()


def test_a_bench_prompts_file(tmp_path):
    from moedesk.bench.speculative import load_prompts
    from moedesk.engine.errors import MoedeskError

    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n' + DEEP + "\n")
    with pytest.raises(MoedeskError, match="neither a JSON list nor JSONL"):
        load_prompts(tmp_path / "p.jsonl", None)
