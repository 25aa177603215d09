"""Model, tokenizer, chat template and cache folder against hostile or unlucky input (issue 19, items 4-7):
one clear line, bounded time and memory, never a traceback."""
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moedesk.engine.load.tokenizer as tokenizer_module
from moedesk.app.batch import BatchSettings, run_batch
from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.engine.runtime import Engine
from tests.app.test_batch_runner import FakeEngine, FakeTokenizer, read_jsonl, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def edit_json(path, **changes):
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


# --- item 4: token ids beyond the model's vocabulary ---------------------------------------------

def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_before_any_line(mixtral, tmp_path, capsys):
    tokenizer = json.loads((mixtral / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 384, "content": "<|evil|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (mixtral / "tokenizer.json").write_text(json.dumps(tokenizer))
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "Hi <|evil|>"}])
    code = main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(mixtral), "--device", "cpu",
                 "--temperature", "0", "--max-new-tokens", "2"])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"moedesk: {mixtral}: the tokenizer has token ids up to 384, outside the model's vocabulary "
                    f"of 384 (vocab_size in its config)")


def test_a_line_whose_text_gives_ids_beyond_the_vocabulary_is_an_error_line(tmp_path):
    # FakeTokenizer gives ids up to 99; this model only has 60, and its tokenizer has no check_vocab.
    lines = [{"id": "low", "prompt": "\x0a\x0b"}, {"id": "high", "prompt": "Hi"}, {"id": "ids", "prompt_ids": [3]}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    code = run_batch(src, tmp_path / "out.jsonl", FakeEngine(vocab_size=60), BatchSettings(temperature=0),
                     stderr=io.StringIO())
    records = read_jsonl(tmp_path / "out.jsonl")
    assert code == 1 and [r["id"] for r in records] == ["low", "high", "ids"]
    assert "error" not in records[0] and "error" not in records[2]
    assert records[1]["error"] == ("line 2: the tokenizer gave token id 82 for this prompt, outside the model's "
                                   "vocabulary [0, 60)")
    assert FakeTokenizer().encode("Hi")[1] == 82


# --- item 5: config dimensions --------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 0}, "config hidden_size must be >= 1, got 0"),
    ({"hidden_size": -64}, "config hidden_size must be >= 1, got -64"),
    ({"hidden_size": 64.5}, "config hidden_size must be an integer, got 64.5"),
    ({"hidden_size": "64"}, 'config hidden_size must be an integer, got "64"'),
    ({"num_attention_heads": 0}, "config num_attention_heads must be from 1 to 1024, got 0"),
    ({"num_attention_heads": 3}, "config num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"num_key_value_heads": 8}, "config num_key_value_heads must be from 1 to 4, got 8"),
    ({"vocab_size": 0}, "config vocab_size must be >= 1, got 0"),
    ({"vocab_size": None}, "config has no 'vocab_size'"),
    ({"vocab_size": 1000}, "tensor model.embed_tokens.weight has shape (384, 64), the config implies (1000, 64)"),
    ({"num_hidden_layers": 10**9}, "config num_hidden_layers must be from 1 to 1024, got 1000000000"),
    ({"num_hidden_layers": 5}, "config num_hidden_layers=5, but the weights have layers 0..2"),
    ({"num_hidden_layers": 2}, "config num_hidden_layers=2, but the weights have layers 0..2"),
    ({"num_local_experts": 64}, "config says 64 experts per layer, but layer 0 of the weights has experts 0..3"),
    ({"num_local_experts": 10**6}, "config num_local_experts must be from 1 to 4096, got 1000000"),
    ({"num_experts_per_tok": 5}, "config num_experts_per_tok must be from 1 to 4, got 5"),
    ({"intermediate_size": 10**6}, "the config implies (1000000, 64) (intermediate_size, hidden_size)"),
    ({"head_dim": 32},
     "tensor model.layers.0.self_attn.q_proj.weight has shape (64, 64), the config implies (128, 64)"),
    ({"rms_norm_eps": -1}, "config rms_norm_eps must be a positive number, got -1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     "config rope rope_theta must be a positive number, got NaN"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope scaling 'linear' without 'factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 256}},
     "config rope high_freq_factor must be larger than low_freq_factor"),
    ({"eos_token_id": [2, "x"]}, 'config eos_token_id must be an integer, got "x"'),
    ({"max_position_embeddings": 0}, "config max_position_embeddings must be >= 1, got 0"),
])
def test_config_dimensions_are_checked_before_anything_is_allocated(mixtral, changes, message):
    edit_json(mixtral / "config.json", **changes)
    started = time.perf_counter()
    with pytest.raises(MoedeskError) as e:
        Engine.load(str(mixtral), device="cpu")
    assert time.perf_counter() - started < 10
    assert str(e.value).startswith(f"{mixtral}: ") and message in str(e.value) and "\n" not in str(e.value)


PARSE_CONFIGS = """
import json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a config that allocates without bound fails here
sys.path.insert(0, sys.argv[1])
from moedesk.engine.model.architectures import parse_config
from moedesk.engine.errors import MoedeskError
shapes = {name: tuple(shape) for name, shape in json.loads(sys.argv[3]).items()}
for hf in json.loads(open(sys.argv[2]).read()):
    try:
        parse_config(hf, "config.json", tensors=shapes)
        print("ok")
    except MoedeskError as e:
        print("error", json.dumps(str(e)))
    except BaseException as e:
        print("TRACEBACK", json.dumps(traceback.format_exc()))
"""


def _random_config_value(rng):
    return rng.choice([None, True, False, 0, 1, -1, 2, 3, 4, 7, 64, 10**9, 2**63, 10**40, 1.5, 64.0, -0.0,
                       float("nan"), float("inf"), 1e-300, "", "64", [], [1, 2], {}, {"rope_type": "llama3"},
                       {"type": "linear", "factor": 0}, {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                                         "high_freq_factor": 1,
                                                         "original_max_position_embeddings": 8192}])


def test_fuzz_config_files(mixtral, tmp_path):
    """Random values in every field of a real config: each parse ends in a config or one line, in bounded memory."""
    from safetensors import safe_open

    base = json.loads((mixtral / "config.json").read_text())
    keys = sorted(set(base) | {"head_dim", "num_experts", "mlp_only_layers", "decoder_sparse_step", "rope_scaling",
                               "rope_parameters", "clip_qkv", "sliding_window", "shared_expert_intermediate_size"})
    rng = random.Random(19)
    configs = []
    for _ in range(400):
        hf = dict(base)
        for key in rng.sample(keys, rng.randrange(1, 4)):
            hf[key] = _random_config_value(rng)
        hf["model_type"] = rng.choice(["mixtral", "mixtral", "llama", "qwen2_moe", "qwen3_moe", "olmoe"])
        configs.append(hf)
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    with safe_open(str(mixtral / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PARSE_CONFIGS, str(REPO), str(tmp_path / "configs.json"),
                           json.dumps(shapes)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = done.stdout.splitlines()
    assert len(results) == len(configs)
    tracebacks = [json.loads(r.split(" ", 1)[1]) for r in results if r.startswith("TRACEBACK")]
    assert not tracebacks, tracebacks[0]
    assert sum(r == "ok" for r in results) > 5 and time.perf_counter() - started < 60
    for r in results:
        if r.startswith("error"):
            assert "\n" not in json.loads(r.split(" ", 1)[1])


# --- item 6: the cache folder ----------------------------------------------------------------------

@pytest.mark.parametrize("where, why", [("file", "it is a file, not a folder"),
                                        ("file/under", "a part of its path is a file, not a folder")])
def test_an_unusable_cache_folder_for_the_demo_is_one_line(tmp_path, monkeypatch, where, why):
    from moedesk.engine.load.demo import demo_checkpoint_dir

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / where))
    started = time.perf_counter()
    with pytest.raises(MoedeskError) as e:
        demo_checkpoint_dir()
    assert time.perf_counter() - started < 2  # refused before the build's work, not after
    assert str(e.value) == (f"{tmp_path / where}: cannot build the demo model in this cache folder ({why}); "
                            f"set MOEDESK_CACHE_DIR to a folder you can write")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_cache_folder_for_the_demo_is_one_line(tmp_path, monkeypatch):
    from moedesk.engine.load.demo import demo_checkpoint_dir

    (tmp_path / "ro").mkdir(mode=0o555)
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "ro"))
    with pytest.raises(MoedeskError, match="cannot build the demo model in this cache folder .Permission denied"):
        demo_checkpoint_dir()


def test_measurements_go_on_without_a_writable_cache_and_say_so_once(tmp_path, monkeypatch, capsys):
    from moedesk.engine.json_cache import cached_json

    (tmp_path / "file").write_text("not a folder")
    calls = []
    for _ in range(3):
        assert cached_json(tmp_path / "file" / "profile-x.json", lambda: calls.append(1) or {"a": 1}) == {"a": 1}
    assert len(calls) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"moedesk: {tmp_path / 'file'}: cannot write the cache folder "
                           f"(it is a file, not a folder); going on")

    def read_only(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", read_only)  # as a read-only folder answers, even to root
    assert cached_json(tmp_path / "ro" / "popularity.json", lambda: [1, 2]) == [1, 2]
    assert "ro: cannot write the cache folder (Permission denied)" in capsys.readouterr().err
    assert not list((tmp_path / "ro").glob("*.tmp"))


def test_profile_runs_on_a_cache_folder_it_cannot_write(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "file"))
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # the kernel cache is another folder's story
    folder = str(tiny_checkpoint("mixtral"))
    assert main(["profile", "--model", folder, "--device", "cpu", "--dtype", "float32", "--gpu-budget", "0"]) == 0
    captured = capsys.readouterr()
    assert "experts on the GPU" in captured.out
    notes = [line for line in captured.err.splitlines() if "cannot write the cache folder" in line]
    assert len(notes) == 1 and "going on without it" in notes[0]


# --- item 7: hostile chat templates ------------------------------------------------------------

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 4000000000 }}",
    "power": "{{ 10 ** 100000000 }}",
    "wide filter": "{{ 'x'|center(4000000000) }}",
    "wide format": "{{ '%999999999d' % 1 }}",
    "wide str.format": "{{ '{:999999999}'.format(1) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "long output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "division": "{{ 1 / 0 }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_chat_template_is_bounded_in_time_and_memory(name, monkeypatch):
    import tokenizers
    from tokenizers import models

    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", 1.0)
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_MAX_GROWTH", 128 << 20)
    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hostile = tokenizer_module.Tokenizer(tok, {"chat_template": HOSTILE[name]}, source="model")
    started = time.perf_counter()
    with pytest.raises(MoedeskError) as e:
        hostile.render_chat([{"role": "user", "content": "hi"}])
    # Unbounded, each of these runs for hours or until the memory is gone; bounded, they stop within about the
    # 1 s limit plus building the last string (6 s seen once on a loaded 2-core machine, so 15 s of slack).
    assert time.perf_counter() - started < 15
    assert str(e.value).startswith("model: chat template failed: ") and "\n" not in str(e.value)
    # The same bounds leave an ordinary template alone.
    fine = tokenizer_module.Tokenizer(tok, {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content|trim }}"
                                                             "{{ '%d' % loop.index }}{% endfor %}"})
    assert fine.render_chat([{"role": "user", "content": " 100% {:9999999} "}]) == "<user>100% {:9999999}1"


def test_a_hanging_template_costs_its_line_not_the_batch(mixtral, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", 0.5)
    edit_json(mixtral / "tokenizer_config.json", chat_template=HOSTILE["nested loops"])
    engine = Engine.load(str(mixtral), device="cpu", dtype="float32")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
                                              {"id": "raw", "prompt": "Hello"}])
    code = run_batch(src, tmp_path / "out.jsonl", engine, BatchSettings(temperature=0, max_new_tokens=2),
                     stderr=io.StringIO())
    records = read_jsonl(tmp_path / "out.jsonl")
    assert code == 1 and [r["id"] for r in records] == ["chat", "raw"] and "error" not in records[1]
    assert records[0]["error"] == f"line 1: {mixtral}: chat template failed: rendering took longer than 0.5 s"


# Issue 46, item 12: one filter or method call that builds a huge value runs between two template lines, where
# the per-line watch never looks. Each is bounded inside the call.
HOSTILE_CALLS = {
    "join": "{{ (['x' * 9999999] * 120)|join }}",
    "str.join": "{{ ''.join(['x' * 9999999] * 120) }}",
    "sorted repeat": "{{ ((range(99999)|list) * 160)|sort|first }}",
    "lipsum": "{{ lipsum(300000) }}",
    "replace": "{{ ('x' * 9999999)|replace('x', 'xxxxxxxxxx') }}",
    "str.replace": "{{ ('x' * 9999999).replace('', 'yyyyyyyy') }}",
    "expandtabs": "{{ ('\t' * 9999999).expandtabs(9999) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CALLS))
def test_a_single_call_in_a_template_is_bounded(name):
    import tracemalloc

    import tokenizers
    from tokenizers import models

    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hostile = tokenizer_module.Tokenizer(tok, {"chat_template": HOSTILE_CALLS[name]}, source="model")
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(MoedeskError) as e:
            hostile.render_chat([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 10
    assert peak < 300 << 20, f"{peak >> 20} MiB"
    assert str(e.value).startswith("model: chat template failed: ") and "\n" not in str(e.value)


def test_a_demo_build_killed_half_way_leaves_nothing_behind_at_the_next(tmp_path):
    # Issue 46, item 17: a kill during the demo build left its 872 MB staging folder for good.
    import subprocess
    import sys

    from moedesk.engine.load.demo import remove_abandoned_builds

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = tmp_path / "moedesk-demo-v1"
    abandoned = tmp_path / f"moedesk-demo-v1.{gone.pid}.abc123"
    running = tmp_path / f"moedesk-demo-v1.{os.getpid()}.def456"
    other = tmp_path / "moedesk-demo-v10.1.x"  # another version's name: not this build's
    for path in (abandoned, running, other):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x" * 100)
    remove_abandoned_builds(folder)
    assert not abandoned.exists() and running.exists() and other.exists()
