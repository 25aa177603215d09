"""A thinking model's reasoning comes back apart from its answer on the llama.cpp engine, through `moedesk serve`:
a tiny random Qwen3-MoE GGUF (tests/gguf_from_hf.py) whose chat template opens a <think> block (Qwen3's manner:
tests/tiny_models.py, TOOLS_TEMPLATE).

Greedily, a random model never closes the block, so its whole reply is reasoning (and, with enable_thinking false,
its whole reply is the answer): that runs through `moedesk serve --engine llama.cpp` as users start it. A reply
with both, reasoning then `</think>` then an answer, is forced token by token by a grammar whose only sentence it is
(llguidance over llama.cpp's own vocabulary, as structured output uses it) on the llama.cpp engine in the server."""
from __future__ import annotations

import pytest

from tests.app.openai_checks import assert_all_reasoning
from tests.app.serve_process import serve_process
from tests.tiny_models import TOOLS_TEMPLATE

openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")
KEY = "k-think"
ASK = [{"role": "user", "content": "Hello, world!"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from tests.gguf_from_hf import build, write_gguf

    built = build("qwen3moe", tmp_path_factory.mktemp("think"))
    return built, write_gguf("qwen3moe", built.folder, built.folder / "thinking.gguf", chat_template=TOOLS_TEMPLATE)


def test_serve_on_llama_cpp_returns_the_reasoning_apart(gguf, monkeypatch):
    from tokenizers import Tokenizer

    built, path = gguf
    decode = Tokenizer.from_file(str(built.folder / "tokenizer.json")).decode
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the llama.cpp engine takes torch's threads: two shared cores
    with serve_process(["--engine", "llama.cpp", "--model", str(path), "--model-name", "thinker", "--context", "512"],
                       KEY, startup_s=180) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300, max_retries=0)
        assert client.models.list().data[0].id == "thinker"
        assert_all_reasoning(client, "thinker", ASK, decode, **GREEDY)
        # Thinking off: the template writes an empty think block, and the reply is the answer.
        off = dict(GREEDY, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
        plain = client.chat.completions.create(model="thinker", messages=ASK, **off)
        assert plain.choices[0].message.content == decode(plain.model_extra["moedesk"]["token_ids"])
        assert "reasoning_content" not in plain.choices[0].message.model_extra


def test_reasoning_then_answer_come_apart_on_the_llama_cpp_engine(gguf, monkeypatch):
    import llguidance

    from moedesk.engine.generation.sampling import Grammar
    from moedesk.engine.runtime import Engine
    from tests.app.test_server import running_server

    _, path = gguf
    engine = Engine.load(str(path), engine="llama.cpp", context_length=512)
    try:
        assert engine.kind == "llama.cpp"
        reply = "The user greets me.\n</think>\n\nHello there!"
        ids = engine.tokenizer.encode(reply, add_special_tokens=False)
        engine.grammar({"type": "text"})  # builds its llguidance view of llama.cpp's vocabulary
        forced = Grammar(engine._grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(
            "start: " + " ".join(f"<[{i}]>" for i in ids)), engine.vocab_size, engine.config.eos_token_ids)
        monkeypatch.setattr(engine, "grammar", lambda response_format: forced)
        with running_server(engine, api_key=KEY, model_name="thinker") as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300, max_retries=0)
            ask = dict(model="thinker", messages=ASK, temperature=0, max_tokens=len(ids) + 4,
                       response_format={"type": "json_object"})  # asks the engine for its (forced) grammar
            whole = client.chat.completions.create(**ask).choices[0]
            assert whole.message.model_extra["reasoning_content"] == "The user greets me."
            assert whole.message.content == "Hello there!" and whole.finish_reason == "stop"
            deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **ask) if c.choices]
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas).strip() == \
                "The user greets me."
            assert "".join(d.content or "" for d in deltas) == "Hello there!"
            assert not any("think>" in (d.content or "") for d in deltas)
    finally:
        engine.close()
