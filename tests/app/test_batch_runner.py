"""`app.batch.run_batch` against the batch file contract (docs/architecture.md, "Contracts other tools
rely on"), with a fake engine.

The fake engine is a test double for the file contract only: it "generates" the prompt's ids
reversed, finishes short sequences first (so completions come back out of input order), and
honours max_new_tokens, context_length, lazy pulling and batch_size like the real one must.
Real-model tests live in tests/app/test_batch.py.
"""
import argparse
import errno
import io
import json
from types import SimpleNamespace

import pytest
import torch

from moedesk.app.batch import BatchSettings, BatchUsageError, add_batch_arguments, check_batch_paths, run_batch, \
    settings_from_args
from moedesk.engine.errors import MoedeskError
from moedesk.engine.load.reply_format import PLAIN
from moedesk.engine.requests import Completion

BOS = 1


class FakeTokenizer:
    """One token per character (ord % 90 + 10), BOS first; chat adds role markers."""

    def __init__(self, chat_template=True):
        self.chat_template = chat_template

    reply_format = PLAIN

    def encode(self, text, add_special_tokens=True):  # the fake's "template" writes no BOS: always add it
        return [BOS] + [ord(c) % 90 + 10 for c in text]

    def render_chat(self, messages, add_generation_prompt=True, tools=None, **options):
        if not self.chat_template:
            raise MoedeskError("fake/tokenizer_config.json: the model has no chat template")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def chat_prompt(self, messages):
        return self.encode(self.render_chat(messages))

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """Echoes each prompt's ids reversed; one token per sequence per step, up to batch_size at once.

    `die_after=k` raises KeyboardInterrupt once k completions were yielded, as a Ctrl-C would.
    """

    description = "fake-moe (test double) on cpu float32"
    device = torch.device("cpu")
    cache = SimpleNamespace(bytes_per_position=lambda: 1 << 20)  # what run_batch sizes an automatic batch from

    def __init__(self, tokenizer=FakeTokenizer(), context_length=64, vocab_size=100, die_after=None):
        self.tokenizer, self.context_length, self.vocab_size = tokenizer, context_length, vocab_size
        self.die_after = die_after
        self.requests = []  # every Request pulled, in pull order
        self.finish_order = []  # tags in the order their completions were yielded
        self.max_active = 0

    def generate(self, requests, batch_size=8, decoding=None):
        source = iter(requests)
        active, exhausted, yielded = [], False, 0
        while active or not exhausted:
            while not exhausted and len(active) < batch_size:  # pull lazily, only to fill free slots
                request = next(source, None)
                if request is None:
                    exhausted = True
                else:
                    self.requests.append(request)
                    active.append([request, []])
            self.max_active = max(self.max_active, len(active))
            for seq in active:  # one decode step
                request, out = seq
                out.append(request.prompt_ids[-1 - len(out) % len(request.prompt_ids)])
            for seq in list(active):
                completion = self._finished(*seq)
                if completion is not None:
                    active.remove(seq)
                    if self.die_after is not None and yielded == self.die_after:
                        raise KeyboardInterrupt
                    self.finish_order.append(completion.tag)
                    yielded += 1
                    yield completion

    def _finished(self, request, out):
        prompt = request.prompt_ids
        if len(out) == len(prompt) and not request.params.ignore_eos:  # the whole prompt echoed: "eos"
            reason = "stop"
        elif len(out) >= request.params.max_new_tokens or len(prompt) + len(out) >= self.context_length:
            reason = "length"
        else:
            return None
        text = self.tokenizer.decode(out) if self.tokenizer else ""
        return Completion(request.tag, list(out), text, reason, len(prompt), {"steps": len(out), "fake": True})


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path):
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "output must be whole lines"
    return [json.loads(line) for line in text.splitlines()]


def batch(tmp_path, lines, engine=None, settings=None, out="out.jsonl", **kwargs):
    """Run a batch over `lines`; returns (exit code, output records, engine, stderr text)."""
    src = write_jsonl(tmp_path / "in.jsonl", lines) if lines is not None else tmp_path / "in.jsonl"
    engine = engine or FakeEngine()
    stderr = io.StringIO()
    kwargs.setdefault("progress", False)
    code = run_batch(src, tmp_path / out, engine, settings or BatchSettings(temperature=0), stderr=stderr, **kwargs)
    return code, read_jsonl(tmp_path / out), engine, stderr.getvalue()


def error_of(records, record_id):
    [record] = [r for r in records if r.get("id") == record_id]
    return record["error"]


# --- happy path -------------------------------------------------------------------------------

def test_all_three_input_kinds(tmp_path):
    code, records, engine, err = batch(tmp_path, [
        {"id": "raw", "prompt": "abc"},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "ids", "prompt_ids": [5, 6, 7]},
    ])
    assert code == 0
    assert [r["id"] for r in records] == ["raw", "chat", "ids"]
    tok = FakeTokenizer()
    prompts = [tok.encode("abc"), tok.chat_prompt([{"role": "user", "content": "hi"}]), [5, 6, 7]]
    for record, prompt in zip(records, prompts):
        assert set(record) == {"id", "text", "token_ids", "finish_reason", "usage", "stats"}
        expected = list(reversed(prompt))[:256]
        assert record["token_ids"] == expected
        assert record["text"] == tok.decode(expected)
        assert record["finish_reason"] == "stop"
        assert record["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(expected)}
        assert record["stats"] == {"steps": len(expected), "fake": True}  # passed through untouched
    assert [r.prompt_ids for r in engine.requests] == prompts
    [summary] = err.splitlines()
    assert summary.startswith("3 ok, 0 failed, 0 skipped, ") and summary.endswith(" tok/s")


def test_output_is_in_input_order_when_completions_finish_out_of_order(tmp_path):
    lengths = [30, 3, 12, 1, 7, 20, 2, 5, 9, 4]
    lines = [{"id": f"s{i}", "prompt_ids": list(range(10, 10 + n))} for i, n in enumerate(lengths)]
    code, records, engine, _ = batch(tmp_path, lines, settings=BatchSettings(temperature=0, batch_size=4))
    assert code == 0
    assert engine.finish_order != sorted(engine.finish_order)  # the fake really did finish out of order
    assert [r["id"] for r in records] == [f"s{i}" for i in range(len(lengths))]
    assert [len(r["token_ids"]) for r in records] == lengths
    assert engine.max_active == 4


def test_input_is_fed_lazily_and_each_line_written_at_once(tmp_path):
    """The engine pulls lines as slots free up; results reach the file before the input is used up."""
    out = tmp_path / "out.jsonl"
    seen_on_disk = []

    class Watching(FakeEngine):
        def generate(self, requests, batch_size=8, decoding=None):
            for completion in super().generate(requests, batch_size):
                seen_on_disk.append((len(self.requests), len(out.read_text().splitlines()) if out.exists() else 0))
                yield completion

    lines = [{"id": f"l{i}", "prompt_ids": [20, 21]} for i in range(50)]
    code, records, _, _ = batch(tmp_path, lines, engine=Watching(), settings=BatchSettings(temperature=0, batch_size=2))
    assert code == 0 and len(records) == 50
    # When the 10th completion comes back, the engine has pulled only a few lines beyond it, and
    # the 9 earlier results are already in the file (flushed line by line).
    pulled, on_disk = seen_on_disk[9]
    assert pulled <= 12
    assert on_disk == 9


def test_blank_lines_and_a_byte_order_mark_are_ignored(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt_ids": [3]}\n\n   \n{"id": "b", "prompt_ids": [4]}')  # no final \n
    code, records, _, _ = batch(tmp_path, None)
    assert code == 0 and [r["id"] for r in records] == ["a", "b"]


# --- per-line parameters ----------------------------------------------------------------------

def test_per_line_overrides_reach_the_sampling_params(tmp_path):
    settings = BatchSettings(max_new_tokens=50, temperature=0.7, top_p=0.9, top_k=40, seed=3, ignore_eos=True)
    code, records, engine, _ = batch(tmp_path, [
        {"id": "default", "prompt_ids": [11]},
        {"id": "custom", "prompt_ids": [12], "max_new_tokens": 4, "temperature": 0, "top_p": 0.5, "seed": 99},
        {"id": "float", "prompt_ids": [13], "temperature": 1.5, "top_p": 1},
    ], settings=settings)
    assert code == 0
    params = {r.prompt_ids[0]: r.params for r in engine.requests}
    assert (params[11].max_new_tokens, params[11].temperature, params[11].top_p, params[11].seed) == (50, 0.7, 0.9, 3)
    assert (params[12].max_new_tokens, params[12].temperature, params[12].top_p, params[12].seed) == (4, 0, 0.5, 99)
    assert (params[13].temperature, params[13].top_p) == (1.5, 1)
    assert all(p.top_k == 40 and p.ignore_eos for p in params.values())  # not per line: always the settings'
    # With ignore_eos the fake runs to max_new_tokens.
    assert [len(r["token_ids"]) for r in records] == [50, 4, 50]
    assert [r["finish_reason"] for r in records] == ["length"] * 3


@pytest.mark.parametrize("override, words", [
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"temperature": -0.1}, "temperature must be in [0, 2]"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"seed": -1}, "seed must be in [0, 2**64)"),
    ({"seed": 2**64}, "seed must be in [0, 2**64)"),
    ({"seed": "7"}, "seed must be an integer"),
])
def test_bad_per_line_parameters_are_error_lines(tmp_path, override, words):
    code, records, engine, _ = batch(tmp_path, [{"id": "x", "prompt_ids": [5], **override},
                                                {"id": "ok", "prompt_ids": [6]}])
    assert code == 1
    assert [r["id"] for r in records] == ["x", "ok"]
    assert error_of(records, "x").startswith("line 1: ")
    assert words in error_of(records, "x")
    assert "text" in records[1]
    assert [r.prompt_ids for r in engine.requests] == [[6]]


def test_a_length_penalty_beyond_the_servers_range_is_an_error_line_or_a_usage_error(tmp_path):
    # 1e308 passed ("finite"), went to the engine, failed the whole beam step with "OverflowError: (34, 'Numerical
    # result out of range')" (length ** 1e308), and cost every beam line in that step a rerun alone.
    code, records, engine, _ = batch(tmp_path, [
        {"id": "huge", "prompt_ids": [5], "beams": 2, "length_penalty": 1e308},
        {"id": "edge", "prompt_ids": [6], "beams": 2, "length_penalty": -10},
    ])
    assert code == 1
    assert records[0]["error"] == "line 1: length_penalty must be in [-10, 10], got 1e+308"
    assert "text" in records[1]
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    with pytest.raises(BatchUsageError, match=r"--length-penalty: length_penalty must be in \[-10, 10\], got 11.0"):
        settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", "--length-penalty", "11"]))


def test_an_unknown_field_is_reported_once_and_the_line_runs(tmp_path):
    # Datasets carry fields of their own (MT-bench's category, question_id): their lines run. A misspelt option
    # ("max_tokens", "temprature") would run with the defaults unseen, so every unknown name is said once on
    # stderr, with what it may have meant.
    code, records, engine, err = batch(tmp_path, [
        {"id": "typo", "prompt_ids": [5], "max_tokens": 3},
        {"id": "typo2", "prompt_ids": [5], "temprature": 0.5, "category": "writing"},
        {"id": "again", "prompt_ids": [5], "category": "coding"},
        {"id": "all_known", "prompt_ids": [6], "max_new_tokens": 2, "temperature": 0, "top_p": 1, "seed": 1,
         "beams": 1, "length_penalty": 1.0, "response_format": None},
    ])
    assert code == 0
    assert [r["id"] for r in records] == ["typo", "typo2", "again", "all_known"] and all("text" in r for r in records)
    notes = [line for line in err.splitlines() if "is not one a line sets" in line]
    assert len(notes) == 3  # max_tokens, temprature, category: each once
    assert notes[0].startswith('moedesk: line 1: field "max_tokens" is not one a line sets, ignored (did you mean '
                               '"max_new_tokens"?); a line takes id, prompt, messages, prompt_ids, max_new_tokens')
    assert 'line 2: field "temprature" is not one a line sets, ignored (did you mean "temperature"?)' in notes[1]
    assert 'line 2: field "category" is not one a line sets, ignored; a line takes' in notes[2]
    assert engine.requests[1].params.temperature == 0  # the misspelt value was not taken


def test_a_line_cannot_ask_for_more_beams_than_the_server_allows(tmp_path):
    # A wider search holds beams x context of KV cache and runs alone: one line asking for 100000 beams took
    # 100000 rows (seconds a token on the tiny test model; on a real one, all the memory there is).
    lines = [{"id": "wide", "prompt_ids": [5], "beams": 100000}, {"id": "ok", "prompt_ids": [6], "beams": 16},
             {"id": "zero", "prompt_ids": [7], "beams": 0}]
    code, records, engine, _ = batch(tmp_path, lines)
    assert code == 1
    assert records[0]["error"] == "line 1: beams must be at most 16, got 100000"
    assert "text" in records[1]
    assert records[2]["error"] == "line 3: beams must be >= 1, got 0"
    # --beams above the limit is the user's own choice: lines may then ask for as many.
    code, records, _, _ = batch(tmp_path, [{"id": "w", "prompt_ids": [5], "beams": 32}],
                                settings=BatchSettings(temperature=0, beams=32), out="wide.jsonl")
    assert code == 0 and "text" in records[0]


# --- bad lines --------------------------------------------------------------------------------

def test_bad_lines_become_error_lines_and_the_run_goes_on(tmp_path):
    lines = [
        {"id": "good1", "prompt": "hello"},
        '{"id": "broken", "prompt": ',
        '[1, 2, 3]',
        {"prompt": "no id"},
        {"id": 7, "prompt": "numeric id"},
        {"id": "empty", "prompt": ""},
        {"id": "empty_ids", "prompt_ids": []},
        {"id": "none"},
        {"id": "two", "prompt": "x", "prompt_ids": [3]},
        {"id": "long", "prompt": "y" * 70},
        {"id": "range", "prompt_ids": [1, 2, 100]},
        {"id": "negative", "prompt_ids": [-1]},
        {"id": "not_ints", "prompt_ids": [1, "2"]},
        {"id": "bad_messages", "messages": [{"role": "user"}]},
        {"id": "good1", "prompt": "duplicate"},
        {"id": "good2", "prompt_ids": [9, 8]},
    ]
    code, records, engine, _ = batch(tmp_path, lines)
    assert code == 1
    assert [r["id"] for r in records] == ["good1", None, None, None, None, "empty", "empty_ids", "none", "two", "long",
                                          "range", "negative", "not_ints", "bad_messages", "good1", "good2"]
    errors = [r.get("error") for r in records]
    assert errors[0] is None and errors[-1] is None
    for number, error in enumerate(errors[1:-1], start=2):
        assert error.startswith(f"line {number}: ") and "\n" not in error
        assert set(records[number - 1]) == {"id", "error"}
    assert "malformed JSON" in errors[1]
    assert "expected a JSON object, got an array" in errors[2]
    assert "missing or non-string id" in errors[3]
    assert "missing or non-string id (got 7)" in errors[4]
    assert errors[5] == "line 6: empty prompt"
    assert errors[6] == "line 7: empty prompt_ids"
    assert "exactly one of prompt, messages, prompt_ids" in errors[7]
    assert "exactly one of prompt, messages, prompt_ids (found prompt and prompt_ids)" in errors[8]
    assert errors[9] == "line 10: prompt has 71 tokens; the model's context is 64"
    assert "100 is outside the vocabulary [0, 100)" in errors[10]
    assert "-1 is outside the vocabulary" in errors[11]
    assert "prompt_ids must be a list of integers" in errors[12]
    assert "'messages[0].content'" in errors[13]
    assert errors[14] == 'line 15: duplicate id "good1" (first on line 1)'
    tok = FakeTokenizer()
    assert [r.prompt_ids for r in engine.requests] == [tok.encode("hello"), [9, 8]]  # only the good lines


def test_prompt_at_the_context_limit(tmp_path):
    code, records, _, _ = batch(tmp_path, [
        {"id": "fits", "prompt_ids": [5] * 63, "max_new_tokens": 10},  # one token of room
        {"id": "full", "prompt_ids": [5] * 64},
    ], settings=BatchSettings(temperature=0, ignore_eos=True))
    assert code == 1
    assert records[0]["finish_reason"] == "length" and len(records[0]["token_ids"]) == 1
    assert records[1]["error"] == "line 2: prompt has 64 tokens; the model's context is 64"


def test_text_prompts_need_a_tokenizer(tmp_path):
    code, records, _, _ = batch(tmp_path, [
        {"id": "text", "prompt": "hi"},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "ids", "prompt_ids": [4, 5]},
    ], engine=FakeEngine(tokenizer=None))
    assert code == 1
    assert "no tokenizer; give prompt_ids instead of prompt" in records[0]["error"]
    assert "no tokenizer; give prompt_ids instead of messages" in records[1]["error"]
    assert records[2]["token_ids"] == [5, 4] and records[2]["text"] == ""


def test_a_model_without_a_chat_template(tmp_path):
    code, records, _, _ = batch(tmp_path, [{"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
                                           {"id": "raw", "prompt": "hi"}],
                                engine=FakeEngine(tokenizer=FakeTokenizer(chat_template=False)))
    assert code == 1
    assert records[0]["error"] == "line 1: fake/tokenizer_config.json: the model has no chat template"
    assert "text" in records[1]


def test_invalid_utf8_and_lone_surrogates(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": "latin1", "prompt": "caf\xe9"}\n{"id": "sur\\ud800", "prompt_ids": [3]}\n')
    code, records, _, _ = batch(tmp_path, None)
    assert code == 1
    assert records[0] == {"id": None, "error": "line 1: not valid UTF-8 (byte 32)"}
    assert records[1]["id"] == "sur\ud800" and records[1]["token_ids"] == [3]  # written, escaped, still JSON


# --- exit codes and usage errors --------------------------------------------------------------

def test_exit_codes(tmp_path):
    assert batch(tmp_path, [{"id": "a", "prompt_ids": [3]}], out="ok.jsonl")[0] == 0
    assert batch(tmp_path, [{"id": "a", "prompt_ids": [3]}, {"id": "b"}], out="bad.jsonl")[0] == 1
    assert batch(tmp_path, [], out="empty.jsonl")[0] == 0


def test_usage_errors(tmp_path):
    engine = FakeEngine()
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_ids": [3]}])
    with pytest.raises(BatchUsageError, match="no such input file"):
        run_batch(tmp_path / "missing.jsonl", tmp_path / "out.jsonl", engine, BatchSettings())
    with pytest.raises(BatchUsageError, match="output folder .* does not exist"):
        run_batch(src, tmp_path / "nodir" / "out.jsonl", engine, BatchSettings())
    with pytest.raises(BatchUsageError, match="is a folder"):
        run_batch(tmp_path, tmp_path / "out.jsonl", engine, BatchSettings())
    with pytest.raises(BatchUsageError, match="must not be the input file"):
        run_batch(src, src, engine, BatchSettings())
    assert issubclass(BatchUsageError, MoedeskError)  # the CLI turns it into exit 2
    assert not (tmp_path / "out.jsonl").exists() and engine.requests == []
    check_batch_paths(src, tmp_path / "out.jsonl")  # fine, and creates nothing
    assert not (tmp_path / "out.jsonl").exists()


def test_command_line_flags():
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["in.jsonl", "-o", "out.jsonl", "--max-new-tokens", "12", "--temperature", "0",
                              "--top-p", "0.8", "--top-k", "5", "--seed", "4", "--ignore-eos", "--batch-size", "3"])
    assert (args.input, args.output) == ("in.jsonl", "out.jsonl")
    assert settings_from_args(args) == BatchSettings(max_new_tokens=12, temperature=0, top_p=0.8, top_k=5, seed=4,
                                                     ignore_eos=True, batch_size=3)
    assert settings_from_args(parser.parse_args(["in.jsonl", "-o", "o"])) == BatchSettings()
    for flag, value in [("--batch-size", "0"), ("--top-p", "2"), ("--top-k", "-1"), ("--max-new-tokens", "0"),
                        ("--temperature", "-1"), ("--seed", "-3"), ("--temperature", "nan")]:
        with pytest.raises(BatchUsageError, match=f"^{flag}: "):
            settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", flag, value]))
    with pytest.raises(SystemExit):
        parser.parse_args(["in.jsonl"])  # -o is required


def test_flags_override_the_app_settings_which_override_the_defaults():
    from moedesk.app.tui.settings import Settings

    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    parser.add_argument("--gpu-budget", type=float, default=None)  # the CLI adds these with the model flags
    parser.add_argument("--dtype", default=None)
    app = Settings(temperature=0.3, top_p=0.9, top_k=7, max_new_tokens=40, seed=None, gpu_budget_gib=2.5,
                   dtype="float16")
    merged = settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", "--top-k", "2"]), app)
    assert merged == BatchSettings(max_new_tokens=40, temperature=0.3, top_p=0.9, top_k=2, seed=0, gpu_budget_gib=2.5,
                                   dtype="float16",
                                   from_app=("max_new_tokens", "temperature", "top_p", "gpu_budget_gib", "dtype"))
    shown = merged.describe()
    assert "temperature=0.3*" in shown and "top_k=2," in shown and "seed=0," in shown and "dtype=float16*" in shown
    flagged = settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", "--dtype", "float32"]), app)
    assert flagged.dtype == "float32" and "dtype" not in flagged.from_app
    auto = settings_from_args(parser.parse_args(["in.jsonl", "-o", "o"]), Settings(dtype="auto"))
    assert auto.dtype is None and "dtype" not in auto.from_app
    assert shown.endswith("(* from the app's settings)")
    parser.add_argument("--expert-dtype", default=None)
    packed = settings_from_args(parser.parse_args(["in.jsonl", "-o", "o"]), Settings(expert_dtype="int4"))
    assert packed.expert_dtype == "int4" and "expert_dtype" in packed.from_app
    flagged = settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", "--expert-dtype", "int8"]),
                                 Settings(expert_dtype="int4"))
    assert flagged.expert_dtype == "int8" and "expert_dtype" not in flagged.from_app
    with pytest.raises(BatchUsageError, match="^--gpu-budget: "):
        settings_from_args(parser.parse_args(["in.jsonl", "-o", "o", "--gpu-budget", "-1"]), app)


# --- kill and resume --------------------------------------------------------------------------

RESUME_LINES = [{"id": f"q{i}", "prompt_ids": list(range(10, 10 + (i * 7) % 11 + 1))} for i in range(12)]
RESUME_LINES[4] = "{not json"
RESUME_LINES[8] = {"id": "q8", "prompt": ""}
RESUME_LINES.insert(10, {"id": "q3", "prompt_ids": [5]})  # duplicate id: an error line keyed by its line number


def reference_output(tmp_path):
    code, records, _, _ = batch(tmp_path, RESUME_LINES, out="reference.jsonl")
    assert code == 1
    return records


@pytest.mark.parametrize("die_after", range(10))
def test_killed_run_resumes_without_duplicates_or_losses(tmp_path, die_after):
    expected = reference_output(tmp_path)
    settings = BatchSettings(temperature=0, batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        batch(tmp_path, RESUME_LINES, engine=FakeEngine(die_after=die_after), settings=settings)
    partial = read_jsonl(tmp_path / "out.jsonl")
    assert partial == expected[:len(partial)]  # a prefix, in order, every line whole
    assert len(partial) < len(expected)

    code, resumed, engine, err = batch(tmp_path, RESUME_LINES, settings=settings)
    assert code == 1
    assert resumed == expected
    ids = [r["id"] for r in resumed if "error" not in r]
    assert len(ids) == len(set(ids))
    assert f"{len(partial)} skipped" in err
    # Only what was missing is asked of the engine again.
    assert len(engine.requests) == len([r for r in expected[len(partial):] if "error" not in r])

    code, again, engine, err = batch(tmp_path, RESUME_LINES, settings=settings)  # nothing left to do
    assert code == 1 and again == expected and engine.requests == []
    assert err.startswith(f"0 ok, 0 failed, {len(expected)} skipped")


def test_partial_last_line_is_cut_off_and_redone(tmp_path):
    expected = reference_output(tmp_path)
    out = tmp_path / "out.jsonl"
    text = (tmp_path / "reference.jsonl").read_text().splitlines(keepends=True)
    out.write_text("".join(text[:5]) + text[5][:17])  # a crash in the middle of writing line 6
    code, resumed, engine, _ = batch(tmp_path, RESUME_LINES)
    assert code == 1
    assert resumed == expected
    assert out.read_text().count("\n") == len(expected)


@pytest.mark.parametrize("room", [0, 150, 700])
def test_a_full_disk_stops_the_run_with_one_line_and_a_rerun_completes_it(tmp_path, monkeypatch, room):
    expected = reference_output(tmp_path)
    real_open = open

    class FullDisk:
        """The output file on a disk with `room` bytes left: the write that does not fit stops part way."""

        def __init__(self, file):
            self.file, self.room = file, room

        def write(self, data):
            if len(data) > self.room:
                self.file.write(data[:self.room])
                self.file.flush()
                self.room = 0
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return FullDisk(file) if mode == "ab" else file

    monkeypatch.setattr("moedesk.app.batch.open", open_on_a_full_disk, raising=False)
    stderr = io.StringIO()
    out = tmp_path / "out.jsonl"
    code = run_batch(write_jsonl(tmp_path / "in.jsonl", RESUME_LINES), out, FakeEngine(), BatchSettings(temperature=0),
                     stderr=stderr, progress=False)
    assert code == 1
    last = stderr.getvalue().splitlines()[-1]
    assert last.startswith(f"moedesk: {out}: cannot write the output (No space left on device)")
    assert "run the same command" in last
    whole = out.read_text().splitlines(keepends=True)
    whole = [json.loads(line) for line in whole if line.endswith("\n")]
    assert whole == expected[:len(whole)] and len(whole) < len(expected)
    assert len(out.read_bytes()) == room  # the line that did not fit is cut, not written twice

    monkeypatch.undo()  # space freed: the same command finishes the job
    code, resumed, _, err = batch(tmp_path, RESUME_LINES)
    assert code == 1 and resumed == expected
    assert f"{len(whole)} skipped" in err


def test_resume_after_a_clean_run_with_only_good_lines_exits_0(tmp_path):
    lines = [{"id": f"g{i}", "prompt_ids": [i + 3]} for i in range(5)]
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        batch(tmp_path, lines, engine=FakeEngine(die_after=2))
    with open(out, "ab") as f:
        f.write(b'{"id": "g2", "te')
    code, records, _, err = batch(tmp_path, lines)
    assert code == 0 and [r["id"] for r in records] == [f"g{i}" for i in range(5)]
    assert err.startswith("3 ok, 0 failed, 2 skipped")


def test_rerun_exit_code_remembers_earlier_failures(tmp_path):
    lines = [{"id": "a", "prompt_ids": [3]}, {"id": "b", "prompt": ""}]
    assert batch(tmp_path, lines)[0] == 1
    code, records, engine, err = batch(tmp_path, lines)
    assert code == 1 and len(records) == 2 and engine.requests == []
    assert "1 of the skipped lines had failed before" in err

    # Also when the earlier failure is a line without a usable id (recognised by its line number).
    lines = [{"id": "a", "prompt_ids": [3]}, "{not json"]
    assert batch(tmp_path, lines, out="null.jsonl")[0] == 1
    code, records, engine, err = batch(tmp_path, lines, out="null.jsonl")
    assert code == 1 and len(records) == 2 and engine.requests == []
    assert err.startswith("0 ok, 0 failed, 2 skipped")


def test_an_engine_error_mid_batch_costs_no_line(tmp_path):
    # The engine fails on its third completion of every call: the lines it held run again one at a
    # time (where it does not fail) and the run goes on; an out-of-memory error also halves the batch.
    class Broken(FakeEngine):
        def generate(self, requests, batch_size=8, decoding=None):
            self.batch_sizes = getattr(self, "batch_sizes", []) + [batch_size]
            for n, completion in enumerate(super().generate(requests, batch_size)):
                if n == 2:
                    raise RuntimeError("CUDA out of memory")
                yield completion

    lines = [{"id": f"e{i}", "prompt_ids": [3] * (i + 1)} for i in range(6)]
    code, records, engine, err = batch(tmp_path, lines, engine=Broken(), settings=BatchSettings(temperature=0,
                                                                                                batch_size=4))
    assert code == 0 and err.splitlines()[-1].startswith("6 ok, 0 failed")  # after the back-off's note
    assert records == batch(tmp_path, lines, out="reference.jsonl")[1]
    assert 2 in engine.batch_sizes and max(engine.batch_sizes) == 4


CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [RuntimeError(CPU_OOM), MemoryError(), torch.OutOfMemoryError("")],
                         ids=["torch-cpu-allocator", "MemoryError", "OutOfMemoryError-without-text"])
def test_running_out_of_memory_anywhere_backs_off_and_says_so(tmp_path, error):
    # Only errors whose text said "out of memory" (CUDA's) used to halve the batch: torch's CPU allocator says
    # "can't allocate memory", Python's MemoryError says nothing; both kept the batch that did not fit, silently.
    class Short(FakeEngine):
        warnings = []

        def generate(self, requests, batch_size=8, decoding=None):
            self.batch_sizes = getattr(self, "batch_sizes", []) + [batch_size]
            for n, completion in enumerate(super().generate(requests, batch_size)):
                if n == 2 and batch_size > 1:
                    self.warnings.append("GPU out of memory while generating; moving 4 experts to RAM")
                    raise error
                yield completion

    lines = [{"id": f"e{i}", "prompt_ids": [3] * (i + 1)} for i in range(8)]
    engine = Short()
    engine.warnings = ["host RAM not pinned"]  # from the load: shown too
    code, records, engine, err = batch(tmp_path, lines, engine=engine,
                                       settings=BatchSettings(temperature=0, batch_size=4))
    assert code == 0 and [r["id"] for r in records] == [f"e{i}" for i in range(8)]
    assert engine.batch_sizes[:2] == [4, 1] and 2 in engine.batch_sizes  # alone for the lines it held, then halved
    notes = err.splitlines()
    assert notes[0] == "moedesk: host RAM not pinned"
    assert "moedesk: GPU out of memory while generating; moving 4 experts to RAM" in notes
    assert any(n.startswith("moedesk: out of memory with up to 4 lines at once") and n.endswith("going on with 2")
               for n in notes), notes
    assert notes[-1].startswith("8 ok, 0 failed")


# --- what goes to stderr ----------------------------------------------------------------------

class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt_ids": [4, 5]} for i in range(4)])
    write_jsonl(tmp_path / "out.jsonl", [{"id": "p0", "text": "", "token_ids": [], "finish_reason": "stop",
                                          "usage": {"prompt_tokens": 2, "completion_tokens": 0}}])
    terminal = FakeTerminal()
    settings = BatchSettings(temperature=0, max_new_tokens=9, dtype="bfloat16", from_app=("dtype",))
    code = run_batch(src, tmp_path / "out.jsonl", FakeEngine(), settings, stderr=terminal, progress=True)
    assert code == 0
    shown = terminal.getvalue()
    assert "fake-moe (test double) on cpu float32" in shown
    assert "max_new_tokens=9," in shown and "temperature=0," in shown and "dtype=bfloat16*" in shown
    assert "4 lines in" in shown and "out.jsonl: 1 (skipped)" in shown
    assert "3/3" in shown and "tok/s" in shown and "ETA" in shown  # rich's bar: this run's lines only
    assert "3 ok, 0 failed, 1 skipped, " in shown.rstrip().splitlines()[-1]  # after rich's show-cursor code


def test_no_terminal_means_one_summary_line(tmp_path):
    for progress in (True, False):  # StringIO is not a terminal: no bar even when asked for one
        code, _, _, err = batch(tmp_path, [{"id": "a", "prompt_ids": [3, 4]}, {"id": "b"}],
                                out=f"out{progress}.jsonl", progress=progress)
        assert code == 1
        [line] = err.splitlines()
        assert line.startswith("1 ok, 1 failed, 0 skipped, ") and line.endswith(" tok/s")


# --- batch size from memory -------------------------------------------------------------------

def test_batch_size_for_memory_fits_half_the_free_memory_within_bounds():
    from moedesk.app.batch import AUTO_BATCH_CAP, batch_size_for_memory

    assert batch_size_for_memory(free_bytes=10 * 2**30, bytes_per_sequence=2**30) == 5
    assert batch_size_for_memory(free_bytes=2**30, bytes_per_sequence=2**31) == 1  # never below one
    assert batch_size_for_memory(free_bytes=2**40, bytes_per_sequence=2**20) == AUTO_BATCH_CAP
    assert batch_size_for_memory(free_bytes=8, bytes_per_sequence=1, share=0.25, cap=100) == 2


def test_run_without_a_batch_size_takes_what_free_memory_holds(tmp_path, monkeypatch):
    import moedesk.app.batch as batch_module

    # FakeEngine: 1 MiB of KV per position, context 64 → 64 MiB per sequence; 640 MiB free → 5 at half.
    monkeypatch.setattr(batch_module, "free_memory_bytes", lambda device: 640 * 2**20)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"l{i}", "prompt_ids": [1, 2, 3]} for i in range(12)])
    terminal, engine = FakeTerminal(), FakeEngine()
    assert run_batch(src, tmp_path / "out.jsonl", engine, BatchSettings(temperature=0, max_new_tokens=4),
                     stderr=terminal, progress=True) == 0
    assert engine.max_active == 5
    assert "batch_size=5 (what free memory holds)" in terminal.getvalue()
    flagged = FakeEngine()  # a batch size given is kept
    assert run_batch(src, tmp_path / "again.jsonl", flagged, BatchSettings(temperature=0, max_new_tokens=4,
                                                                          batch_size=3), stderr=io.StringIO()) == 0
    assert flagged.max_active == 3


def test_one_temperature_range_for_the_app_batch_and_serve():
    # Issue 46, item 8: the app took up to 5, batch anything, serve up to 2.
    from moedesk.app.batch import _check_param
    from moedesk.app.tui.settings import FIELDS_BY_NAME
    from moedesk.engine.requests import TEMPERATURE_MAX

    assert TEMPERATURE_MAX == 2.0
    _check_param("temperature", 2.0)
    with pytest.raises(ValueError, match=r"in \[0, 2\]"):
        _check_param("temperature", 2.5)
    assert FIELDS_BY_NAME["temperature"].parse("2") == 2.0
    with pytest.raises(ValueError):
        FIELDS_BY_NAME["temperature"].parse("2.5")


def test_the_header_says_auto_not_none():
    text = BatchSettings(temperature=0).describe()
    assert "dtype=auto" in text and "gpu_budget_gib=auto" in text and "None" not in text


def test_batch_help_lists_every_field_a_line_may_set(capsys):
    # Issue 46, item 8: `moedesk batch --help` did not say what a line may hold.
    from moedesk.app.batch import LINE_FIELDS
    from moedesk.app.cli import main

    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(field in text for field in LINE_FIELDS) and "response_format" in text
